// The sliding window's one piece of arithmetic every backend shares (the CPU and CUDA kernels, and the
// range checks that must check exactly the block-table entries the kernels read). Plain C++ (and
// CUDA host + device), no torch headers, so every kernel TU may include it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVPAGE_HOST_DEVICE __host__ __device__
#else
#define KVPAGE_HOST_DEVICE
#endif

namespace kvpage {

// The first block a sliding window of `window` tokens lets a query at position first_pos, or any
// later one, read: keys are visible in (p - window, p]. 0 without a window (window <= 0). Kernels
// start there, so the table entries before it are never read: the block manager may put
// NULL_BLOCK (any id) in them.
KVPAGE_HOST_DEVICE inline int64_t first_window_block(int64_t first_pos, int64_t window, int64_t block_size) {
  return window > 0 && first_pos >= window ? (first_pos - window + 1) / block_size : 0;
}

}  // namespace kvpage
