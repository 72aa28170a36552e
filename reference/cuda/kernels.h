// The float64 kernels of reference-cuda: everything but the three products (cuBLAS DGEMM), one launch each on
// `stream`. Host-callable declarations only, so reference_cuda.cpp is plain C++. Row-major buffers on the device.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace simpo::reference::cuda::kernels {

// out[i] = bf16 bits in[i] widened exactly to double.
void widen_bf16(const std::uint16_t* in, double* out, std::int64_t n, cudaStream_t stream);

// z[r, v] += bias[v] for the rows x V block z.
void add_bias(double* z, std::int64_t rows, std::int64_t V, const double* bias, cudaStream_t stream);

// Per row r of the rows x V block z (global row first_row + r): lse, the token log-prob (0 where the target is
// ignore_index) and the sum of the logits, with the CPU reference's formulation (reference.cpp): lse = max +
// log1p(sum of exp(z - max) over every entry but the first maximum), log-prob (z_t - max) - log1p(...).
void row_statistics(const double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target,
                    std::int64_t ignore_index, std::int64_t first_row, double* lse, double* logprob, double* logit_sum,
                    cudaStream_t stream);

// In place: z[r, v] = k (onehot - softmax) = -k exp(z - lse), and -k expm1(logprob) at the target; a row with
// k = 0 (ignored, or no gradient) becomes exactly zero.
void logit_gradient(double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target, std::int64_t first_row,
                    const double* lse, const double* logprob, const double* k, cudaStream_t stream);

// Before logit_gradient overwrites the logits: per row with k != 0, norm = sqrt(sum over v != target of p_v^2)
// and max = max over v != target of p_v (p = exp(z - lse)); 0 and 0 where k = 0 (reference.h OffTargetSoftmax).
void off_target_softmax(const double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target, std::int64_t first_row,
                        const double* lse, const double* k, double* norm, double* max, cudaStream_t stream);

// grad_bias[v] += sum over the rows of dz[r, v].
void accumulate_bias_gradient(const double* dz, std::int64_t rows, std::int64_t V, double* grad_bias,
                              cudaStream_t stream);

}  // namespace simpo::reference::cuda::kernels
