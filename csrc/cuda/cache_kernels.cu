// Cache data movement: writing new K/V by slot mapping, and block copies (copy_blocks within a
// device, swap_blocks between the GPU and mapped pinned host memory). All of it is bandwidth
// bound, so every kernel moves 16-byte vectors and keeps several loads in flight per thread.
#include "device_utils.cuh"

namespace kvpage {
namespace cuda {
namespace {

constexpr int kCacheWriteThreads = 128;
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per thread before the stores

// One CTA per token writes its K and V rows (num_kv_heads x head_size each) into the slot.
// Vectorised: one thread moves 16 bytes; scalar fallback for oddly strided inputs.
template <bool kVectorized>
__global__ void __launch_bounds__(kCacheWriteThreads) reshape_and_cache_kernel(const CacheWriteParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) return;  // -1 = padding; beyond = rejected by range checks
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int es = p.element_size;
  const int unit = kVectorized ? 16 : es;              // bytes per move
  const int units_per_row = p.head_size * es / unit;
  const int total = p.num_kv_heads * units_per_row;
  for (int i = threadIdx.x; i < total; i += kCacheWriteThreads) {
    const int h = i / units_per_row, u = i % units_per_row;
    const int64_t dst = (((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size) * es + u * unit;
    const int64_t ksrc = (token * p.key_token_stride + h * p.key_head_stride) * es + u * unit;
    const int64_t vsrc = (token * p.value_token_stride + h * p.value_head_stride) * es + u * unit;
    const char* k = static_cast<const char*>(p.key) + ksrc;
    const char* v = static_cast<const char*>(p.value) + vsrc;
    char* kd = static_cast<char*>(p.key_cache) + dst;
    char* vd = static_cast<char*>(p.value_cache) + dst;
    if (kVectorized) {
      *reinterpret_cast<uint4*>(kd) = *reinterpret_cast<const uint4*>(k);
      *reinterpret_cast<uint4*>(vd) = *reinterpret_cast<const uint4*>(v);
    } else if (es == 4) {
      *reinterpret_cast<uint32_t*>(kd) = *reinterpret_cast<const uint32_t*>(k);
      *reinterpret_cast<uint32_t*>(vd) = *reinterpret_cast<const uint32_t*>(v);
    } else {
      *reinterpret_cast<uint16_t*>(kd) = *reinterpret_cast<const uint16_t*>(k);
      *reinterpret_cast<uint16_t*>(vd) = *reinterpret_cast<const uint16_t*>(v);
    }
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

cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.vectorized) {
    reshape_and_cache_kernel<true><<<p.num_tokens, kCacheWriteThreads, 0, stream>>>(p);
  } else {
    reshape_and_cache_kernel<false><<<p.num_tokens, kCacheWriteThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
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
