// SIMPO_HOST_DEVICE: a function compiled for CUDA kernels and plain C++ alike (fused/simpo_math.h,
// verifier/element_error.h), so host and device round the same way.
#pragma once

#if defined(__CUDACC__)
#define SIMPO_HOST_DEVICE __host__ __device__
#else
#define SIMPO_HOST_DEVICE
#endif
