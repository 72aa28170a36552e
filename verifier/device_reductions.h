// The comparison's reductions as CUDA kernels (device_compare.cu): host-callable, no project types beyond
// element_error.h, so the kernels' translation unit never includes Eigen. Each call runs on its own stream of
// `device` and waits for it; partial results come back per block and merge on the host (element_error.h).
#pragma once

#include "verifier/element_error.h"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace simpo::verifier::device {

// How the candidate's elements are stored.
enum class Storage : int { bf16, f16, f32, f64 };

// One (exact, candidate) pair in device memory: n float64 exact values and n candidate values.
struct Pair {
  const double* exact = nullptr;
  const void* candidate = nullptr;
  Storage storage = Storage::f32;
  element::Rounding rounding = element::Rounding::f32;
  std::int64_t n = 0;
  int device = 0;
};

element::ElementSums totals(const Pair&);
// Per row of row_length consecutive elements, into a host array of n / row_length.
void rows(const Pair&, std::int64_t row_length, element::RowSums* out);
element::BeyondCount beyond(const Pair&, double atol, double rtol);
double exact_at(const Pair&, std::int64_t i);
double candidate_at(const Pair&, std::int64_t i);

// Device memory helpers for the judge: a copy of host bytes on `device` (freed with the last copy of the pointer),
// bytes back to the host, and a wait for all of the device's work (a candidate written on another stream, e.g.
// torch's, is complete after it).
std::shared_ptr<const void> upload(const void* host, std::size_t bytes, int device);
void download(void* host, const void* device_data, std::size_t bytes, int device);
void synchronize(int device);

}  // namespace simpo::verifier::device
