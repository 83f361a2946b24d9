// Paged decode on tensor cores for GQA groups: fp16 / bf16 queries over a cache of their own
// dtype, a group of 2 or more query heads, head sizes up to 128 (decode_uses_tensor_cores).
//
// Why: the SIMT kernel spends ~70 warp instructions per token (dot products, shuffle trees,
// conversions), half an SM's issue slots at full memory bandwidth. Here a group's heads share
// every K/V row through mma.sync, a few instructions per token. The roles are transposed so the
// group, not the tokens, is the narrow side: S^T = K Q^T is an m16n8k16 product with 16 tokens as
// rows (K straight from shared memory through ldmatrix) and up to 8 heads as columns (Q^T, in
// registers for the whole CTA); O^T += V^T P^T has 16 dims as rows (V through ldmatrix.trans) and
// the heads as columns again. P^T's B fragment is S^T's accumulator transposed: packed to 16 bits
// and moved across lanes by movmatrix.trans, no shared-memory round trip.
//
// Grid and split as the SIMT kernel (attention_decode_common.cuh): one CTA per query row, KV
// head and tile of 8 of its query heads, and partition. K/V stream through the same cp.async ring,
// in rows padded by 16 bytes (conflict-free ldmatrix); each of the 4 warps takes 16 tokens of a
// 64-token stage and keeps its own online softmax (the heads' running max and sum, the O^T
// accumulators: every lane owns 2 heads), merged across warps at the end as in the SIMT kernel.
#pragma once

#include "attention_decode_common.cuh"

namespace kvpage {
namespace cuda {
namespace {

template <typename T, int HEAD>
struct MmaDecodeConfig {
  static constexpr int kHeadsPerCta = 8;  // mma n: the tile's query heads (zeros past the group)
  static constexpr int kWarpTokens = 16;  // mma m of S^T: a warp's tokens per stage
  static constexpr int kStageTokens = kDecodeWarps * kWarpTokens;
  static constexpr int kStride = HEAD + 8;  // elements in a padded shared-memory row
  static constexpr int kSlotBytes = kStride * int(sizeof(T));
  static constexpr int kDimTiles = HEAD / 16;  // k-steps of S^T, m16 tiles of O^T
  // A ring of at most ~72 KiB: 3 stages up to head size 64 (4 CTAs per SM), else 2 (3 per SM).
  static constexpr int kStages = cmin(3, cmax(2, 73728 / (2 * kStageTokens * kSlotBytes)));
  // Registers aim at 4 CTAs per SM (<= 128 a thread: Q^T, O^T and one step's S^T are ~60).
  static constexpr int kMinBlocksPerSm = 4;
  using Ring = KvRing<T, HEAD, kStageTokens, kSlotBytes, kStages>;
  static_assert(HEAD % 16 == 0, "head sizes are whole mma k-steps");
  static_assert(WarpStates<kHeadsPerCta, HEAD>::kBytes <= Ring::kValidOffset, "the merge reuses the K/V ring");
};

// One online-softmax step of a warp's 16 tokens. s: S^T's accumulator, logits in the log2 domain
// (-inf where masked): the lane holds tokens g (s[0], s[1]) and g + 8 (s[2], s[3]) of heads 2t
// and 2t + 1. Updates those heads' running max and lane-partial sum, rescales their O^T, and
// leaves P = exp2(s - max) in s.
template <int kDimTiles>
__device__ __forceinline__ void online_softmax_heads(float (&s)[4], float (&o)[kDimTiles][4], float (&m)[2],
                                                     float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = fmaxf(s[h], s[h + 2]);
#pragma unroll
    for (int off = 4; off < kWarpSize; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_new = fmaxf(m[h], mx);
    // A head with nothing visible yet keeps a zero base so exp2f(-inf - base) is a clean 0.
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m[h] - base);
    s[h] = exp2f(s[h] - base);
    s[h + 2] = exp2f(s[h + 2] - base);
    l[h] = l[h] * alpha + s[h] + s[h + 2];  // lane-partial; the 8 lanes of a head add up at the end
    m[h] = m_new;
#pragma unroll
    for (int i = 0; i < kDimTiles; ++i) o[i][h] *= alpha, o[i][h + 2] *= alpha;
  }
}

template <typename T, int HEAD>
__global__ void __launch_bounds__(kDecodeThreads, (MmaDecodeConfig<T, HEAD>::kMinBlocksPerSm))
    paged_decode_mma_kernel(const AttentionParams p, const DecodeWork w) {
  using C = MmaDecodeConfig<T, HEAD>;
  constexpr int kStride = C::kStride, kDimTiles = C::kDimTiles;
  DecodeCta cta;
  if (!decode_cta<C::kHeadsPerCta>(p, w, cta)) return;  // a partition past the row's end
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates

  // Q^T, the B operand of S^T = K Q^T: head g's dims 16k + 2t, + 1 (q[k][0]) and + 8, + 9
  // (q[k][1]), raw 16-bit pairs; zeros past the tile's heads and the runtime head size.
  uint32_t q[kDimTiles][2];
  const uint16_t* qh = static_cast<const uint16_t*>(p.query) + int64_t(cta.row) * p.q_row_stride +
                       int64_t(cta.head0 + g) * p.q_head_stride;
#pragma unroll
  for (int k = 0; k < kDimTiles; ++k) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int d = 16 * k + 2 * t + 8 * i;
      q[k][i] = g < cta.num_heads && d < p.head_size ? uint32_t(qh[d]) | uint32_t(qh[d + 1]) << 16 : 0u;
    }
  }
  const float qk_scale = p.scale * kLog2e * p.k_scale;

  float o[kDimTiles][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kDimTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  // ldmatrix row addresses: K as S^T's A (lane l: token l % 16, dims 8 (l / 16) of the k-step);
  // V as O^T's A, transposed (lane l: token l % 8 + 8 (l / 16), dims 8 (l / 8 % 2) of the tile).
  const int k_offset = (lane & 15) * kStride + (lane >> 4) * 8;
  const int v_offset = ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;

  extern __shared__ __align__(16) unsigned char smem[];
  typename C::Ring ring(p, cta, smem);
  stream_kv(ring, cta.begin, [&](int stage) {
    const T* k_s = reinterpret_cast<const T*>(ring.keys(stage)) + warp * C::kWarpTokens * kStride;
    const T* v_s = reinterpret_cast<const T*>(ring.values(stage)) + warp * C::kWarpTokens * kStride;
    const bool* valid = ring.valid(stage) + warp * C::kWarpTokens;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < kDimTiles; ++k) {
      uint32_t a[4];
      ldmatrix_x4(a, k_s + k_offset + 16 * k);
      mma_16816<T>(s, a, q[k][0], q[k][1]);
    }
    const bool lo = valid[g], hi = valid[g + 8];
    s[0] = lo ? soft_cap(s[0] * qk_scale, p.softcap) : -INFINITY;
    s[1] = lo ? soft_cap(s[1] * qk_scale, p.softcap) : -INFINITY;
    s[2] = hi ? soft_cap(s[2] * qk_scale, p.softcap) : -INFINITY;
    s[3] = hi ? soft_cap(s[3] * qk_scale, p.softcap) : -INFINITY;
    online_softmax_heads(s, o, m, l);
    // P^T as the B operand of O^T += V^T P^T: tokens 2t, + 1 (b0) and + 8, + 9 (b1) of head g.
    const uint32_t b0 = movmatrix_trans(pack2<T>(s[0], s[1]));
    const uint32_t b1 = movmatrix_trans(pack2<T>(s[2], s[3]));
#pragma unroll
    for (int k = 0; k < kDimTiles; ++k) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, v_s + v_offset + 16 * k);
      mma_16816<T>(o[k], a, b0, b1);
    }
  });

  // The warps' states into the ring (free now): o[k][e] is dim 16k + g + 8 (e / 2) of head
  // 2t + e % 2; the heads' sums add over the lanes g.
  const WarpStates<C::kHeadsPerCta, HEAD> states(smem);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int off = 4; off < kWarpSize; off *= 2) l[h] += __shfl_xor_sync(0xffffffffu, l[h], off);
    if (g == 0) states.max[warp][2 * t + h] = m[h], states.sum[warp][2 * t + h] = l[h];
  }
#pragma unroll
  for (int k = 0; k < kDimTiles; ++k) {
#pragma unroll
    for (int e = 0; e < 4; ++e) states.acc[warp][2 * t + e % 2][16 * k + g + 8 * (e / 2)] = o[k][e];
  }
  __syncthreads();
  store_merged<T>(p, w, cta, states);
}

}  // namespace
}  // namespace cuda
}  // namespace kvpage
