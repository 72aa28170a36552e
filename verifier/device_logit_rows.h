// The bf16_logits profile's per-row pass (error_bounds.cpp, ProblemScales::add_logit_rounding) on a CUDA device:
// the problem's logits, softmax terms and the C^2 sums of each row from three float64 cuBLAS products and two row
// kernels, where the host takes O(N H V) in Eigen. Host-callable, no project types (the kernels' translation unit
// never includes Eigen); logit_rounding.h wraps it for a Problem.
#pragma once

#include <cstdint>

namespace simpo::verifier::device {

// What add_logit_rounding needs of one token row r (README "The bf16_logits profile"): the sums of |z_v| and z_v^2
// over the row (every row), and for rows with a target in [0, V): the worst and variance terms of its log-prob's
// error, B (the softmax perturbation's size), C (grad_x's; with gradients only) and 1 - p_target. Zero elsewhere.
struct LogitRow {
  double abs_sum = 0, sq_sum = 0;
  double worst_l = 0, var_l = 0, b_row = 0, c_row = 0, target_gap = 0;
};

// The problem's inputs on the host, as the device pass reads them.
struct LogitRowsInput {
  const void* x = nullptr;       // [N, H]
  const void* weight = nullptr;  // [V, H]
  const void* bias = nullptr;    // [V] or null
  int element_bytes = 2;         // 2 (bf16 or f16) or 4 (f32)
  bool f16 = false;              // 2-byte elements are f16, not bf16
  const std::int64_t* target = nullptr;  // [N]
  std::int64_t N = 0, H = 0, V = 0, ignore_index = -100;
  bool gradients = false;  // C as well (two more products per chunk)
  int device = 0;
};

// Fills out[0..N). False, with nothing written, where there is no such device or its free memory cannot hold the
// inputs in float64 and one row's buffers (the caller then runs the host pass); throws std::runtime_error for any other CUDA or
// cuBLAS failure.
bool logit_rows(const LogitRowsInput&, LogitRow* out);

}  // namespace simpo::verifier::device
