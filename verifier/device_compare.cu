// The comparison's reductions on the device (device_reductions.h): the element arithmetic is element_error.h's,
// the same the host loops run; each block reduces a contiguous range of elements and its partial result merges
// on the host, in block order.
#include "verifier/device_reductions.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace simpo::verifier::device {

namespace {

constexpr int threads = 256;
constexpr std::int64_t max_blocks = 2048;  // enough to fill an H100/H200 several times over; few partials to merge

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("device comparison: ") + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for the call and restores the caller's device after it.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~OnDevice() { cudaSetDevice(previous_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = 0;
};

// Stream-ordered scratch on the per-thread stream: no device-wide synchronization to allocate or free it.
template <class T> class Scratch {
 public:
  explicit Scratch(std::int64_t n) {
    check(cudaMallocAsync(reinterpret_cast<void**>(&p_), static_cast<std::size_t>(n) * sizeof(T), cudaStreamPerThread),
          "cudaMallocAsync (partial results)");
  }
  ~Scratch() { cudaFreeAsync(p_, cudaStreamPerThread); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

__device__ inline double load(const __nv_bfloat16* c, std::int64_t i) { return static_cast<double>(__bfloat162float(c[i])); }
__device__ inline double load(const __half* c, std::int64_t i) { return static_cast<double>(__half2float(c[i])); }
__device__ inline double load(const float* c, std::int64_t i) { return static_cast<double>(c[i]); }
__device__ inline double load(const double* c, std::int64_t i) { return c[i]; }

// Tree reduction of one value per thread in shared memory; thread 0 ends with the block's result.
template <class R> __device__ R reduce_block(R mine) {
  // Raw storage: a __shared__ array of a class with member initializers would need dynamic initialization.
  __shared__ alignas(alignof(R)) unsigned char raw[threads * sizeof(R)];
  R* shared = reinterpret_cast<R*>(raw);
  shared[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) shared[threadIdx.x].merge(shared[threadIdx.x + stride]);
    __syncthreads();
  }
  return shared[0];
}

// Block b reduces elements [b per_block, (b + 1) per_block).
template <class C>
__global__ void totals_kernel(const double* exact, const C* cand, std::int64_t n, std::int64_t per_block,
                              element::Rounding rounding, element::ElementSums* partial) {
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * per_block;
  const std::int64_t end = begin + per_block < n ? begin + per_block : n;
  element::ElementSums mine;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) mine.add(i, exact[i], load(cand, i), rounding);
  const element::ElementSums block = reduce_block(mine);
  if (threadIdx.x == 0) partial[blockIdx.x] = block;
}

template <class C>
__global__ void beyond_kernel(const double* exact, const C* cand, std::int64_t n, std::int64_t per_block, double atol,
                              double rtol, element::BeyondCount* partial) {
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * per_block;
  const std::int64_t end = begin + per_block < n ? begin + per_block : n;
  element::BeyondCount mine;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) mine.add(exact[i], load(cand, i), atol, rtol);
  const element::BeyondCount block = reduce_block(mine);
  if (threadIdx.x == 0) partial[blockIdx.x] = block;
}

// One block per row.
template <class C>
__global__ void rows_kernel(const double* exact, const C* cand, std::int64_t row_length, element::Rounding rounding,
                            element::RowSums* out) {
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * row_length;
  element::RowSums mine;
  for (std::int64_t h = threadIdx.x; h < row_length; h += blockDim.x) mine.add(exact[first + h], load(cand, first + h), rounding);
  const element::RowSums row = reduce_block(mine);
  if (threadIdx.x == 0) out[blockIdx.x] = row;
}

// Calls f with the candidate pointer typed by its storage.
template <class F> void with_candidate(const Pair& p, F f) {
  switch (p.storage) {
    case Storage::bf16: return f(static_cast<const __nv_bfloat16*>(p.candidate));
    case Storage::f16: return f(static_cast<const __half*>(p.candidate));
    case Storage::f32: return f(static_cast<const float*>(p.candidate));
    case Storage::f64: return f(static_cast<const double*>(p.candidate));
  }
}

// Launches kernel(per_block, partial) over blocks of contiguous ranges and merges the partials in block order.
template <class R, class Launch> R reduce(const Pair& p, Launch launch) {
  OnDevice on(p.device);
  R all;
  if (p.n == 0) return all;
  const std::int64_t blocks = std::min<std::int64_t>(max_blocks, (p.n + threads - 1) / threads);
  const std::int64_t per_block = (p.n + blocks - 1) / blocks;
  Scratch<R> partial(blocks);
  launch(static_cast<unsigned>(blocks), per_block, partial.get());
  check(cudaGetLastError(), "launching a reduction");
  std::vector<R> host(static_cast<std::size_t>(blocks));
  check(cudaMemcpyAsync(host.data(), partial.get(), host.size() * sizeof(R), cudaMemcpyDeviceToHost, cudaStreamPerThread),
        "partial results to the host");
  check(cudaStreamSynchronize(cudaStreamPerThread), "a reduction");
  for (const R& r : host) all.merge(r);
  return all;
}

}  // namespace

element::ElementSums totals(const Pair& p) {
  return reduce<element::ElementSums>(p, [&](unsigned blocks, std::int64_t per_block, element::ElementSums* partial) {
    with_candidate(p, [&](auto cand) {
      totals_kernel<<<blocks, threads, 0, cudaStreamPerThread>>>(p.exact, cand, p.n, per_block, p.rounding, partial);
    });
  });
}

element::BeyondCount beyond(const Pair& p, double atol, double rtol) {
  return reduce<element::BeyondCount>(p, [&](unsigned blocks, std::int64_t per_block, element::BeyondCount* partial) {
    with_candidate(p, [&](auto cand) {
      beyond_kernel<<<blocks, threads, 0, cudaStreamPerThread>>>(p.exact, cand, p.n, per_block, atol, rtol, partial);
    });
  });
}

void rows(const Pair& p, std::int64_t row_length, element::RowSums* out) {
  OnDevice on(p.device);
  const std::int64_t count = row_length > 0 ? p.n / row_length : 0;
  if (count == 0) return;
  if (count > 0x7fffffff) throw std::runtime_error("device comparison: more rows than one launch takes");
  Scratch<element::RowSums> sums(count);
  with_candidate(p, [&](auto cand) {
    rows_kernel<<<static_cast<unsigned>(count), threads, 0, cudaStreamPerThread>>>(p.exact, cand, row_length, p.rounding, sums.get());
  });
  check(cudaGetLastError(), "launching the row sums");
  check(cudaMemcpyAsync(out, sums.get(), static_cast<std::size_t>(count) * sizeof(element::RowSums), cudaMemcpyDeviceToHost,
                        cudaStreamPerThread),
        "row sums to the host");
  check(cudaStreamSynchronize(cudaStreamPerThread), "the row sums");
}

double exact_at(const Pair& p, std::int64_t i) {
  double v = 0;
  download(&v, p.exact + i, sizeof v, p.device);
  return v;
}

double candidate_at(const Pair& p, std::int64_t i) {
  OnDevice on(p.device);
  double v = 0;
  with_candidate(p, [&](auto cand) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cand)>>;
    T one;
    check(cudaMemcpy(&one, cand + i, sizeof one, cudaMemcpyDeviceToHost), "a candidate element to the host");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) v = static_cast<double>(__bfloat162float(one));
    else if constexpr (std::is_same_v<T, __half>) v = static_cast<double>(__half2float(one));
    else v = static_cast<double>(one);
  });
  return v;
}

std::shared_ptr<const void> upload(const void* host, std::size_t bytes, int device) {
  OnDevice on(device);
  void* p = nullptr;
  if (bytes > 0) check(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes (a candidate tensor)").c_str());
  std::shared_ptr<const void> owned(p, [device](const void* q) {
    if (!q) return;
    OnDevice on_free(device);
    cudaFree(const_cast<void*>(q));
  });
  if (bytes > 0) check(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "a candidate tensor to the device");
  return owned;
}

void download(void* host, const void* device_data, std::size_t bytes, int device) {
  OnDevice on(device);
  check(cudaMemcpy(host, device_data, bytes, cudaMemcpyDeviceToHost), "a tensor to the host");
}

void synchronize(int device) {
  OnDevice on(device);
  check(cudaDeviceSynchronize(), "waiting for the candidate's device work");
}

}  // namespace simpo::verifier::device
