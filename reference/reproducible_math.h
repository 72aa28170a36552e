// Arithmetic whose results are the same bits on every x86-64 CPU, for the golden fixtures (Options::reproducible).
// - The three matrix products in one fixed summation order: plain loops (ascending index, one accumulator per
//   output, no threads), compiled without FMA contraction. A BLAS picks kernels by vector width and cache size
//   and splits work by thread count, and each choice reorders the sums.
// - exp, log1p and expm1 correctly rounded (MPFR): glibc's libm picks an FMA or a plain variant of exp and log at
//   load time by CPU, and the two differ in the last bit now and then (measured on the fixtures: 4 of 15 files
//   changed with glibc's FMA variants masked off). A correctly rounded result has one right answer.
// Far slower than the BLAS path and libm; the fixtures are small. Row-major operands.
#pragma once

#include <cstdint>

namespace simpo::reference::reproducible {

double exp(double);
double log1p(double);
double expm1(double);

// z[r, v] = sum_h x[r, h] w[v, h]                     (rows x V, K = H)
void logits(const double* x, const double* w, double* z, std::int64_t rows, std::int64_t V, std::int64_t H);
// grad_x[r, h] = sum_v dz[r, v] w[v, h]               (rows x H, K = V)
void grad_x(const double* dz, const double* w, double* grad_x, std::int64_t rows, std::int64_t V, std::int64_t H);
// grad_w[v, h] += sum_r dz[r, v] x[r, h], rows in ascending order added straight into grad_w
void accumulate_grad_weight(const double* dz, const double* x, double* grad_w, std::int64_t rows, std::int64_t V,
                            std::int64_t H);

}  // namespace simpo::reference::reproducible
