// The three products of the fast path through OpenBLAS (cblas_dgemm). OpenBLAS chooses its kernels for the CPU it
// finds at run time (Haswell, SkylakeX, Zen, ...), so the portable build's GEMMs run at the speed of the machine
// they land on; Eigen's products are fixed at compile time. Same shapes and row-major layout as
// reproducible_math.h's fixed-order loops, which the reproducible mode uses instead.
#pragma once

#include <cstdint>
#include <string>

namespace simpo::reference::blas {

// z[r, v] = sum_h x[r, h] w[v, h]                     (rows x V, K = H)
void logits(const double* x, const double* w, double* z, std::int64_t rows, std::int64_t V, std::int64_t H);
// grad_x[r, h] = sum_v dz[r, v] w[v, h]               (rows x H, K = V)
void grad_x(const double* dz, const double* w, double* grad_x, std::int64_t rows, std::int64_t V, std::int64_t H);
// grad_w[v, h] += sum_r dz[r, v] x[r, h]; with overwrite, grad_w = the sum (its old contents never read: the
// first piece spares a pass zeroing V H doubles, 4.2 GB at the published workload).
void accumulate_grad_weight(const double* dz, const double* x, double* grad_w, std::int64_t rows, std::int64_t V,
                            std::int64_t H, bool overwrite = false);

// The threads OpenBLAS gives each product (process-wide); returns the previous count.
int set_threads(int);

// "OpenBLAS 0.3.21 ... (kernel Zen, 2 threads)": what the products ran on, for the bench's report.
std::string description();

}  // namespace simpo::reference::blas
