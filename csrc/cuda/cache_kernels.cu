// Cache data movement: writing new K/V by slot mapping (quantising into fp8 caches), and block
// copies (copy_blocks within a device, swap_blocks between the GPU and mapped pinned host
// memory). All of it is bandwidth bound, so every kernel moves 8- or 16-byte vectors and keeps
// several loads in flight per thread.
#include "device_utils.cuh"

namespace kvpage {
namespace cuda {
namespace {

constexpr int kCacheWriteThreads = 128;
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per thread before the stores

// Grid (token, side): side 0 writes key into key_cache, side 1 value into value_cache (or
// first_side alone when the two sides need different kernels). Index data is untrusted: a slot
// outside the cache is skipped.
__device__ __forceinline__ const CacheWriteSource& write_side(const CacheWriteParams& p, int first_side) {
  return first_side + blockIdx.y == 0 ? p.key : p.value;
}

// Same-dtype write: one CTA per (token, side) copies num_kv_heads rows of bytes into the slot.
// Vectorised: one thread moves 16 bytes; scalar fallback for oddly strided inputs.
template <bool kVectorized>
__global__ void __launch_bounds__(kCacheWriteThreads)
    reshape_and_cache_kernel(const CacheWriteParams p, int first_side) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) return;  // -1 = padding; beyond = rejected by range checks
  const CacheWriteSource& src = write_side(p, first_side);
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int es = dtype_size(src.dtype);
  const int unit = kVectorized ? 16 : es;              // bytes per move
  const int units_per_row = p.head_size * es / unit;
  const int total = p.num_kv_heads * units_per_row;
  for (int i = threadIdx.x; i < total; i += kCacheWriteThreads) {
    const int h = i / units_per_row, u = i % units_per_row;
    const int64_t dst =
        (((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size) * es + u * unit;
    const int64_t from = (token * src.token_stride + h * src.head_stride) * es + u * unit;
    const char* x = static_cast<const char*>(src.data) + from;
    char* d = static_cast<char*>(src.cache) + dst;
    if (kVectorized) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(x);
    } else if (es == 4) {
      *reinterpret_cast<uint32_t*>(d) = *reinterpret_cast<const uint32_t*>(x);
    } else {
      *reinterpret_cast<uint16_t*>(d) = *reinterpret_cast<const uint16_t*>(x);
    }
  }
}

constexpr int kFp8Chunk = 8;  // values quantised per thread step: one 8-byte store

// Eight consecutive T values as floats: 16-byte loads when the source allows them.
template <typename T, bool kVectorized>
__device__ __forceinline__ void load8_as_float(const T* x, float* f) {
  if constexpr (kVectorized) {
    constexpr int kPerLoad = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < kFp8Chunk; i += kPerLoad) unpack<T>(*reinterpret_cast<const uint4*>(x + i), f + i);
  } else {
#pragma unroll
    for (int i = 0; i < kFp8Chunk; ++i) f[i] = to_float(x[i]);
  }
}

// fp8 write: one CTA per (token, side) quantises num_kv_heads rows of T (device_utils.cuh's
// quantize_fp8x8) into the slot, 8 values per thread step. Cache rows are 16-byte multiples
// (head_size % 16 == 0), so the 8-byte stores are aligned.
template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kCacheWriteThreads)
    reshape_and_cache_fp8_kernel(const CacheWriteParams p, int first_side) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) return;
  const CacheWriteSource& src = write_side(p, first_side);
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int chunks_per_row = p.head_size / kFp8Chunk;
  const int total = p.num_kv_heads * chunks_per_row;
  for (int i = threadIdx.x; i < total; i += kCacheWriteThreads) {
    const int h = i / chunks_per_row, c = (i % chunks_per_row) * kFp8Chunk;
    const T* x = static_cast<const T*>(src.data) + token * src.token_stride + h * src.head_stride + c;
    float f[kFp8Chunk];
    load8_as_float<T, kVectorized>(x, f);
    uint8_t* d = static_cast<uint8_t*>(src.cache) +
                 ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size + c;
    *reinterpret_cast<uint2*>(d) = quantize_fp8x8(f, src.inverse_scale);
  }
}

// Grid (pair, tensor) over (pairs x tensors), strided so each CTA copies one whole block of one
// tensor. Reads of mapped pinned host memory travel over PCIe; many CTAs each with several
// 16-byte loads outstanding keep the link busy, which a per-block cudaMemcpy cannot.
template <bool kAligned16>
__global__ void __launch_bounds__(kCopyThreads)
    block_copy_kernel(const BlockCopyTensor* __restrict__ tensors, int num_tensors,
                      const int64_t* __restrict__ pairs, int64_t num_pairs) {
  for (int64_t item = blockIdx.x; item < num_pairs * num_tensors; item += gridDim.x) {
    const int64_t pair = item % num_pairs;
    const BlockCopyTensor tt = tensors[item / num_pairs];
    const int64_t src_block = pairs[2 * pair], dst_block = pairs[2 * pair + 1];
    if (src_block < 0 || src_block >= tt.src_blocks || dst_block < 0 || dst_block >= tt.dst_blocks) continue;
    const char* src = reinterpret_cast<const char*>(tt.src) + src_block * tt.block_bytes;
    char* dst = reinterpret_cast<char*>(tt.dst) + dst_block * tt.block_bytes;
    if (kAligned16) {
      const uint4* s = reinterpret_cast<const uint4*>(src);
      uint4* d = reinterpret_cast<uint4*>(dst);
      const int64_t n = tt.block_bytes / 16;
      for (int64_t i = threadIdx.x; i < n; i += kCopyThreads * kCopyUnroll) {
        uint4 buf[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t k = i + u * kCopyThreads;
          if (k < n) buf[u] = __ldcs(s + k);  // streamed once: don't keep it in cache
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t k = i + u * kCopyThreads;
          if (k < n) __stcs(d + k, buf[u]);
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < tt.block_bytes; i += kCopyThreads) dst[i] = src[i];
    }
  }
}

}  // namespace

namespace {

// Launches the sides [first_side, first_side + num_sides) with one kernel; they share its
// template arguments (source dtype, vectorisation).
cudaError_t launch_cache_write(const CacheWriteParams& p, int first_side, int num_sides,
                               cudaStream_t stream) {
  const CacheWriteSource& src = first_side == 0 ? p.key : p.value;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), num_sides);
  if (p.cache_dtype != DType::kFp8E4M3) {
    if (src.vectorized) {
      reshape_and_cache_kernel<true><<<grid, kCacheWriteThreads, 0, stream>>>(p, first_side);
    } else {
      reshape_and_cache_kernel<false><<<grid, kCacheWriteThreads, 0, stream>>>(p, first_side);
    }
    return cudaGetLastError();
  }
  if (!dispatch_dtype(src.dtype, [&](auto t) {
        using T = decltype(t);
        if (src.vectorized) {
          reshape_and_cache_fp8_kernel<T, true><<<grid, kCacheWriteThreads, 0, stream>>>(p, first_side);
        } else {
          reshape_and_cache_fp8_kernel<T, false><<<grid, kCacheWriteThreads, 0, stream>>>(p, first_side);
        }
      })) {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  // One launch for both sides unless key and value need different kernels (an fp8 cache fed
  // keys and values of different dtypes, or one side not 16-byte loadable).
  if (p.key.dtype == p.value.dtype && p.key.vectorized == p.value.vectorized) {
    return launch_cache_write(p, 0, 2, stream);
  }
  const cudaError_t err = launch_cache_write(p, 0, 1, stream);
  return err != cudaSuccess ? err : launch_cache_write(p, 1, 1, stream);
}

cudaError_t launch_block_copy(const BlockCopyTensor* tensors, int num_tensors, const int64_t* pairs,
                              int64_t num_pairs, int64_t max_block_bytes, bool all_aligned16,
                              cudaStream_t stream) {
  const int64_t items = num_pairs * num_tensors;
  if (items == 0 || max_block_bytes == 0) return cudaSuccess;
  // Enough CTAs to fill any current GPU several times over; the grid-stride loop takes the rest.
  const unsigned grid = static_cast<unsigned>(items < 65536 ? items : 65536);
  if (all_aligned16) {
    block_copy_kernel<true><<<grid, kCopyThreads, 0, stream>>>(tensors, num_tensors, pairs, num_pairs);
  } else {
    block_copy_kernel<false><<<grid, kCopyThreads, 0, stream>>>(tensors, num_tensors, pairs, num_pairs);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kvpage
