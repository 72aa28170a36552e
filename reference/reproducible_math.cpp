// Fixed-order products and correctly rounded elementary functions (reproducible_math.h). Compiled with -ffp-contract=off (reference/CMakeLists.txt):
// a fused multiply-add rounds once where a multiply then an add rounds twice, so contraction would make the
// bits depend on whether the compiler targeted an FMA-capable CPU. Vectorizing across independent outputs is
// allowed (each output's sum keeps its order); reordering one output's sum is not, and GCC never does that
// without -ffast-math / -fassociative-math.
#include "reference/reproducible_math.h"

#include <mpfr.h>

namespace simpo::reference::reproducible {

namespace {

// f(x) rounded once, to nearest, from MPFR's exact-enough evaluation at double precision (53 bits): MPFR
// guarantees correct rounding, so every machine gets the same double.
double correctly_rounded(int (*f)(mpfr_ptr, mpfr_srcptr, mpfr_rnd_t), double x) {
  // A double's exponent range (per thread in MPFR), so that underflow and overflow happen where they would for
  // a double and mpfr_subnormalize can round a tiny result once, as a subnormal.
  const mpfr_exp_t emin = mpfr_get_emin(), emax = mpfr_get_emax();
  mpfr_set_emin(-1073);
  mpfr_set_emax(1024);
  mpfr_t value;
  mpfr_init2(value, 53);
  mpfr_set_d(value, x, MPFR_RNDN);
  const int inexact = f(value, value, MPFR_RNDN);
  mpfr_subnormalize(value, inexact, MPFR_RNDN);  // results below 2^-1022 round as a double's subnormals do
  const double result = mpfr_get_d(value, MPFR_RNDN);
  mpfr_clear(value);
  mpfr_set_emin(emin);
  mpfr_set_emax(emax);
  return result;
}

}  // namespace

double exp(double x) { return correctly_rounded(mpfr_exp, x); }
double log1p(double x) { return correctly_rounded(mpfr_log1p, x); }
double expm1(double x) { return correctly_rounded(mpfr_expm1, x); }

void logits(const double* x, const double* w, double* z, std::int64_t rows, std::int64_t V, std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t v = 0; v < V; ++v) {
      double sum = 0;
      for (std::int64_t h = 0; h < H; ++h) sum += x[r * H + h] * w[v * H + h];
      z[r * V + v] = sum;
    }
}

void grad_x(const double* dz, const double* w, double* grad_x, std::int64_t rows, std::int64_t V, std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r) {
    double* out = grad_x + r * H;
    for (std::int64_t h = 0; h < H; ++h) out[h] = 0;
    for (std::int64_t v = 0; v < V; ++v) {
      const double d = dz[r * V + v];
      for (std::int64_t h = 0; h < H; ++h) out[h] += d * w[v * H + h];
    }
  }
}

void accumulate_grad_weight(const double* dz, const double* x, double* grad_w, std::int64_t rows, std::int64_t V,
                            std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t v = 0; v < V; ++v) {
      const double d = dz[r * V + v];
      double* out = grad_w + v * H;
      for (std::int64_t h = 0; h < H; ++h) out[h] += d * x[r * H + h];
    }
}

}  // namespace simpo::reference::reproducible
