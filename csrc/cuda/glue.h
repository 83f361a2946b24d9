// Helpers for the ATen side of the CUDA ops (ops_*.cpp): tensors -> kernel parameters, streams,
// error propagation. Not included by any .cu file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "kernel_params.h"

namespace kvpage {
namespace cuda {

// The kernels' dtype code of a tensor dtype the shared checks (checks.h) have accepted.
inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat;
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFp8E4M3;
    default: TORCH_CHECK_TYPE(false, "kvpage CUDA kernels have no ", t, " variant");
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Kernels index rows, heads and blocks with 32-bit ints.
inline int as_int(int64_t v, const char* what) {
  TORCH_CHECK_VALUE(v >= 0 && v <= std::numeric_limits<int32_t>::max(), what, " = ", v,
                    " does not fit the CUDA kernels' 32-bit indices");
  return static_cast<int>(v);
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Streaming multiprocessors of the current device (cached: the attribute query is a driver call).
int num_sms();
// Compute capability major of the current device (cached likewise).
int compute_capability_major();
// Shared memory one SM holds for its resident CTAs, in bytes (cached likewise).
int shared_memory_per_sm();

// Uploads host int64 words to the device through a pinned staging buffer, asynchronously on
// the current stream (the caching host allocator keeps the buffer alive until the copy is done).
at::Tensor upload_words(const std::vector<int64_t>& words, const at::Device& device);

}  // namespace cuda
}  // namespace kvpage
