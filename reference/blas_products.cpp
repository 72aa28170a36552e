// cblas_dgemm on row-major buffers (blas_products.h). Debian's OpenBLAS takes 32-bit dimensions; every dimension
// here is a tensor extent (B*T rows, H, V), checked to fit before the call rather than silently wrapped.
#include "reference/blas_products.h"

#include "problem/problem.h"

#include <cblas.h>

#include <climits>
#include <string>

namespace simpo::reference::blas {

namespace {

blasint dimension(std::int64_t n, const char* name) {
  if (n < 0 || n > INT_MAX)
    throw InputError(std::string("reference: ") + name + " = " + std::to_string(n) +
                     " exceeds the BLAS's 32-bit dimensions (2147483647)");
  return static_cast<blasint>(n);
}

}  // namespace

void logits(const double* x, const double* w, double* z, std::int64_t rows, std::int64_t V, std::int64_t H) {
  const blasint m = dimension(rows, "rows"), n = dimension(V, "V"), k = dimension(H, "H");
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0, x, k, w, k, 0.0, z, n);
}

void grad_x(const double* dz, const double* w, double* grad_x, std::int64_t rows, std::int64_t V, std::int64_t H) {
  const blasint m = dimension(rows, "rows"), n = dimension(H, "H"), k = dimension(V, "V");
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0, dz, k, w, n, 0.0, grad_x, n);
}

void accumulate_grad_weight(const double* dz, const double* x, double* grad_w, std::int64_t rows, std::int64_t V,
                            std::int64_t H, bool overwrite) {
  const blasint m = dimension(V, "V"), n = dimension(H, "H"), k = dimension(rows, "rows");
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, k, 1.0, dz, m, x, n, overwrite ? 0.0 : 1.0, grad_w, n);
}

int set_threads(int threads) {
  const int previous = openblas_get_num_threads();
  openblas_set_num_threads(threads);
  return previous;
}

std::string description() {
  return std::string(openblas_get_config()) + " (kernel " + openblas_get_corename() + ", " +
         std::to_string(openblas_get_num_threads()) + " threads)";
}

}  // namespace simpo::reference::blas
