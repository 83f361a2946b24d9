// Emulator stand-in: the default stream; kernels run to completion at launch.
#pragma once
#include <cuda_runtime.h>

namespace c10 {
namespace cuda {
struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(int = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
