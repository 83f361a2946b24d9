// Paged varlen causal prefill kernels, FlashAttention-2 style on tensor cores: fp16 / bf16
// queries over a cache of their own dtype or an fp8 (e4m3) one, sm_80+ (fp32 queries prefill
// through attention_decode).
//
// One CTA takes a tile of kBlockM query tokens of one sequence and one query head; its 4 warps
// own kMTiles m16 tiles each (32 rows a warp up to head size 128, else 16), or, at head size 64
// for a grid short of a CTA per SM, its 8 warps 16 rows each. K/V tiles of kBlockN
// cache positions are gathered through the block table into shared memory with cp.async, in a
// ring of 2-3 buffers so the next tiles' gathers overlap this tile's math. S = Q K^T and
// O += P V run on mma.sync m16n8k16 with fp32 accumulators, operands read with ldmatrix; each K / V
// fragment a warp reads feeds all its m-tiles, since shared-memory bandwidth, not the tensor
// cores, bounds this loop. The softmax is online (running max and sum per row, in registers).
// Query position i of a sequence with q_len queries and seq_len cached tokens is
// seq_len - q_len + i and sees positions <= it, which covers plain prefill, chunked prefill and
// prefix-cache hits alike.
//
// fp8 caches: cp.async lands the raw codes in a staging ring of as many buffers; once a tile has
// landed, the CTA converts it into the same 16-bit mma tile the other caches gather into (every
// e4m3 value is exact in fp16 and bf16, so the mma sees the codes' values unrounded). k_scale
// folds into the logits' scale and v_scale into the final normalisation, as in decode.
//
// The (sequence, tile) of a CTA comes from a prefix sum of each sequence's tile count, computed
// on the device by a one-warp kernel, so launching needs no host copy of query_start_loc.
//
// Included only by the attention_prefill_<cache>_<query>.cu files, each of which instantiates
// launch_prefill for one (query dtype, cache dtype) pair, so the pairs compile in parallel.
#pragma once

#include "attention_prefill.h"

namespace kvpage {
namespace cuda {
namespace {

// T: query / out and mma operand type (fp16 / bf16); Cache: T or Fp8E4M3. kWarps: 4, or 8 for a
// grid short of a CTA per SM at head size 64 (launch_prefill_for_head).
template <typename T, typename Cache, int HEAD, int kWarps = 4>
struct PrefillConfig {
  static constexpr bool kFp8 = std::is_same<Cache, Fp8E4M3>::value;
  static constexpr int kThreads = kWarps * kWarpSize;
  // m16 tiles per warp: two (FA2's 128-row CTA) halve the shared-memory reads per mma, but their
  // O accumulators take HEAD floats a lane, so past head size 128 a warp keeps 16 rows. 8-warp
  // CTAs keep 128 rows as 16 a warp: with one CTA per SM (a short grid), each warp's serial
  // chain of tiles, not shared-memory bandwidth, bounds the time, and twice the warps shorten it.
  static constexpr int kMTiles = kWarps == 4 && HEAD <= 128 ? 2 : 1;
  static constexpr int kBlockM = kWarps * 16 * kMTiles;  // query rows per CTA
  // Keys per K/V tile: O and S (kMTiles * kBlockN / 2 floats a lane) stay in registers, unspilled.
  static constexpr int kBlockN = HEAD <= 128 ? 64 : 32;
  static constexpr int kStride = HEAD + 8;  // padded smem row: conflict-free ldmatrix
  static constexpr int kChunksPerRow = HEAD / 8;  // 16-byte chunks of a Q row
  static constexpr int kKeySteps = HEAD / 16;      // k-steps of S = Q K^T
  static constexpr int kSTiles = kBlockN / 8;      // n-tiles of S
  static constexpr int kOTiles = HEAD / 8;         // n-tiles of O
  // Where cp.async lands K/V: the mma tiles themselves (16-bit caches, two buffers), or (fp8)
  // two buffers of raw codes in unpadded rows, converted into one mma tile.
  static constexpr int kCacheVec = 16 / sizeof(Cache);  // cache elements per 16-byte chunk
  static constexpr int kCacheChunksPerRow = HEAD / kCacheVec;
  static constexpr int kStageStride = kFp8 ? HEAD : kStride;  // in Cache elements
  static constexpr int kGatherUnroll = kFp8 && HEAD == 128 && std::is_same<T, __nv_bfloat16>::value ? 1 : 2;
  // K/V tiles in flight: a ring of kStages buffers, the gathers of the next kStages - 1 tiles
  // overlapping this one's math. 3 up to head size 64, whose tiles are small and whose math is
  // short next to a gather's latency (SmolLM2's 1k-token prefill is 72 CTAs, one per SM, each a
  // serial chain of 16 tiles); 2 above, where a third buffer would cost a CTA per SM.
  static constexpr int kStages = HEAD <= 64 ? 3 : 2;
  static constexpr int kTileBuffers = kFp8 ? 1 : kStages;
  static constexpr size_t kTileBytes = size_t(2 * kBlockN) * kStride * sizeof(T);  // K + V
  static constexpr size_t kStageBytes = kFp8 ? size_t(kStages * 2 * kBlockN) * HEAD : 0;
  static constexpr size_t kSmemBytes =
      size_t(kBlockM) * kStride * sizeof(T) + kTileBuffers * kTileBytes + kStageBytes;
};

// Tile offsets: offsets[s] = sum over sequences before s of ceil(q_len / kBlockM).
template <int kBlockM>
__global__ void prefill_tile_offsets_kernel(const int32_t* query_start_loc, int num_seqs,
                                            int num_tokens, int32_t* offsets) {
  const int lane = threadIdx.x;
  int carry = 0;
  for (int base = 0; base < num_seqs; base += kWarpSize) {
    const int s = base + lane;
    int tiles = 0;
    if (s < num_seqs) {
      const int start = min(max(query_start_loc[s], 0), num_tokens);
      const int end = min(max(query_start_loc[s + 1], start), num_tokens);
      tiles = (end - start + kBlockM - 1) / kBlockM;
    }
    int incl = tiles;  // inclusive warp scan
#pragma unroll
    for (int off = 1; off < kWarpSize; off *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += x;
    }
    if (s < num_seqs) offsets[s] = carry + incl - tiles;
    carry += __shfl_sync(0xffffffffu, incl, kWarpSize - 1);
  }
  if (lane == 0) offsets[num_seqs] = carry;
}

// S = Q K^T for a warp's kMTiles m16 tiles x kBlockN keys; q_w: the warp's first Q row, k_s:
// the K tile (rows = keys), both row-major in smem. One ldmatrix.x4 gives an m-tile's A fragment
// (matrices rows 0-7 / 8-15 x dims 0-7 / 8-15: lane l addresses row l % 16, dim 8 (l / 16)), one
// more the B fragments of two n-tiles (keys 0-7 x dims 0-7 / 8-15, then keys 8-15: lane l
// addresses key l % 8 + 8 (l / 16), dim 8 (l / 8 % 2)); each B fragment feeds every m-tile.
template <typename C, typename T>
__device__ __forceinline__ void warp_qk(float (&s)[C::kMTiles][C::kSTiles][4], const T* q_w, const T* k_s,
                                        int lane) {
  static_assert(C::kSTiles % 2 == 0, "K fragments come two n-tiles at a time");
  const T* qa = q_w + (lane & 15) * C::kStride + (lane >> 4) * 8;
  const T* kb = k_s + ((lane & 7) + (lane >> 4) * 8) * C::kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int mi = 0; mi < C::kMTiles; ++mi) {
#pragma unroll
    for (int n = 0; n < C::kSTiles; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.f;
  }
#pragma unroll
  for (int kk = 0; kk < C::kKeySteps; ++kk) {
    uint32_t a[C::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; ++mi) ldmatrix_x4(a[mi], qa + mi * 16 * C::kStride + kk * 16);
#pragma unroll
    for (int n = 0; n < C::kSTiles; n += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, kb + n * 8 * C::kStride + kk * 16);
#pragma unroll
      for (int mi = 0; mi < C::kMTiles; ++mi) {
        mma_16816<T>(s[mi][n], a[mi], b[0], b[1]);
        mma_16816<T>(s[mi][n + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// One online-softmax step of an m16 tile. s: its scaled, masked logits (log2 domain); the lane
// holds rows g (e = 0, 1) and g + 8 (e = 2, 3). Updates those rows' running max and lane-partial
// sum, rescales their O, and leaves P = exp2(s - max) in s.
template <int kSTiles, int kOTiles>
__device__ __forceinline__ void online_softmax(float (&s)[kSTiles][4], float (&o)[kOTiles][4], float (&row_max)[2],
                                               float (&row_sum)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_max[h], mx);
    // A row with nothing visible yet keeps a zero base so exp2f(-inf - base) is a clean 0.
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(row_max[h] - base);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[n][e] = exp2f(s[n][e] - base);
        sum += s[n][e];
      }
    }
    row_sum[h] = row_sum[h] * alpha + sum;  // lane-partial; the 4 lanes of a row add up at the end
    row_max[h] = m_new;
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) o[i][2 * h] *= alpha, o[i][2 * h + 1] *= alpha;
  }
}

// O += P V for a warp's m-tiles. Two S n-tiles form one A fragment (FA2's register reuse); V
// fragments come from row-major smem through ldmatrix.trans, each feeding every m-tile.
template <typename C, typename T>
__device__ __forceinline__ void warp_pv(float (&o)[C::kMTiles][C::kOTiles][4],
                                        const float (&s)[C::kMTiles][C::kSTiles][4], const T* v_s, int lane) {
  const T* vrow = v_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * C::kStride + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
    uint32_t a[C::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < C::kMTiles; ++mi) {
      a[mi][0] = pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
      a[mi][1] = pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
      a[mi][2] = pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
      a[mi][3] = pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int d = 0; d < C::kOTiles / 2; ++d) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, vrow + kk * 16 * C::kStride + d * 16);
#pragma unroll
      for (int mi = 0; mi < C::kMTiles; ++mi) {
        mma_16816<T>(o[mi][2 * d], a[mi], b[0], b[1]);
        mma_16816<T>(o[mi][2 * d + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// kOptions: whether the call has a sliding window, softcap or sinks. The kernel without them has
// none of their code and values: it is the one tuned to the register budget (at head size 128 it
// holds 255 registers unspilled, and their few live values spilled it).
template <typename T, typename Cache, int HEAD, int kWarps, bool kOptions>
__global__ void __launch_bounds__(PrefillConfig<T, Cache, HEAD, kWarps>::kThreads)
    paged_prefill_kernel(const AttentionParams p, const int32_t* __restrict__ tile_offsets) {
  using C = PrefillConfig<T, Cache, HEAD, kWarps>;
  const int window = kOptions ? p.window : 0;
  const float softcap = kOptions ? p.softcap : 0.f;
  constexpr int kThreads = C::kThreads;
  constexpr int kBlockM = C::kBlockM, kBlockN = C::kBlockN, kStride = C::kStride, kCpr = C::kChunksPerRow;
  constexpr int kCacheVec = C::kCacheVec, kCacheCpr = C::kCacheChunksPerRow, kStageStride = C::kStageStride;

  // Which (sequence, query tile): last s with tile_offsets[s] <= tile. Tiles run in reverse:
  // a sequence's later tiles see more keys, so the heaviest CTAs start first and the grid's
  // tail is made of light ones.
  const int tile = tile_offsets[p.num_seqs] - 1 - static_cast<int>(blockIdx.x);
  if (tile < 0) return;
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  // Same clamps as the offsets kernel: untrusted indices never leave their tensors.
  const int q_start = min(max(p.query_start_loc[seq], 0), p.num_rows);
  const int q_end = min(max(p.query_start_loc[seq + 1], q_start), p.num_rows);
  const int q_len = q_end - q_start;
  const int64_t capacity = int64_t(p.max_blocks_per_seq) * p.block_size;
  const int kv_len = static_cast<int>(min(max(int64_t(p.seq_lens[seq]), int64_t(0)), capacity));
  const int m0 = (tile - tile_offsets[seq]) * kBlockM;
  const int first_pos = kv_len - q_len;  // cache position of query 0
  // Last key any row of this tile sees is first_pos + min(m0 + kBlockM, q_len) - 1.
  const int kv_end = max(0, min(kv_len, first_pos + min(m0 + kBlockM, q_len)));
  // First key any row sees: its first row's window start. Gathers start at its K/V tile and skip
  // the positions before it, so the table entries of blocks no row can see are never read.
  const int kv_first = window > 0 ? max(0, first_pos + m0 - window + 1) : 0;

  const int head = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* kv_s = q_s + kBlockM * kStride;  // [kTileBuffers][K, V][kBlockN][kStride]
  // cp.async's K/V destination, [kStages buffers][K, V][kBlockN][kStageStride]: kv_s itself, or
  // the fp8 staging area after it.
  Cache* stage = reinterpret_cast<Cache*>(kv_s + (C::kFp8 ? C::kTileBuffers * 2 * kBlockN * kStride : 0));

  const int tid = threadIdx.x;
  const int chunks = p.head_size / 8;  // runtime head size may be below HEAD: zero-filled

  // Q tile: rows past q_len and dims past head_size are zeros.
  {
    const T* qbase = static_cast<const T*>(p.query) + int64_t(head) * p.q_head_stride;
    for (int idx = tid; idx < kBlockM * kCpr; idx += kThreads) {
      const int r = idx / kCpr, c = idx % kCpr;
      const bool valid = m0 + r < q_len && c < chunks;
      const T* src = valid ? qbase + int64_t(q_start + m0 + r) * p.q_row_stride + c * 8 : qbase;
      cp_async16(q_s + r * kStride + c * 8, src, valid);
    }
  }

  const int32_t* table = p.block_tables + int64_t(seq) * p.max_blocks_per_seq;
  const int log2_bs = __ffs(p.block_size) - 1;
  const Cache* kcache = static_cast<const Cache*>(p.key_cache);
  const Cache* vcache = static_cast<const Cache*>(p.value_cache);
  const int cache_chunks = p.head_size / kCacheVec;

  // Gathers cache positions [j * kBlockN, +kBlockN) of this KV head into buffer `buf`.
  auto load_kv = [&](int j, int buf) {
    Cache* k_dst = stage + buf * 2 * kBlockN * kStageStride;
    Cache* v_dst = k_dst + kBlockN * kStageStride;
    // Two rows' table lookups in flight: a full unroll hoists every row's address math into
    // registers, which 32-row warps' accumulators leave too few of (it spills at head size 128).
    // One for bf16 queries over fp8 at head size 128, which spilled 8 bytes at two on sm_90.
#pragma unroll (C::kGatherUnroll)
    for (int idx = tid; idx < kBlockN * kCacheCpr; idx += kThreads) {
      const int r = idx / kCacheCpr, c = idx % kCacheCpr;
      const int pos = j * kBlockN + r;
      const int block = pos < kv_end && (!kOptions || pos >= kv_first) ? __ldg(table + (pos >> log2_bs)) : -1;
      const bool valid = block >= 0 && block < p.num_blocks && c < cache_chunks;
      const int64_t off =
          valid ? ((int64_t(block) * p.num_kv_heads + kv_head) * p.block_size + (pos & (p.block_size - 1))) *
                          p.head_size + c * kCacheVec
                : 0;
      cp_async16(k_dst + r * kStageStride + c * kCacheVec, kcache + off, valid);
      cp_async16(v_dst + r * kStageStride + c * kCacheVec, vcache + off, valid);
    }
  };

  // fp8: the codes of staging buffer `buf` as exact T values in the mma tile, K and V rows alike
  // (masked chunks were zero-filled by cp.async and stay zeros). Each thread turns 8 codes into
  // one 16-byte chunk, so a warp's reads and its writes both cover consecutive addresses (16-code
  // units, written as two chunks 32 bytes apart, made 2-way bank conflicts).
  auto convert_kv = [&](int buf) {
    constexpr int kUnitsPerRow = HEAD / 8;
    const Cache* src = stage + buf * 2 * kBlockN * kStageStride;
    for (int idx = tid; idx < 2 * kBlockN * kUnitsPerRow; idx += kThreads) {
      const int r = idx / kUnitsPerRow, c = idx % kUnitsPerRow;
      const uint2 codes = *reinterpret_cast<const uint2*>(src + r * kStageStride + c * 8);
      *reinterpret_cast<uint4*>(kv_s + r * kStride + c * 8) = fp8x8_to<T>(codes);
    }
  };

  // The ring over K/V tiles j0 .. num_kv_tiles - 1 (j0: the tile of kv_first): tiles j0 ..
  // j0 + kStages - 2 in flight before the loop (group 0 holds Q too); iteration j waits for tile j,
  // then refills the buffer tile j - 1 used (every thread is past it: the barrier) with tile
  // j + kStages - 1; tile j sits in buffer (j - j0) % kStages. One commit group per tile, empty
  // ones included, keeps wait<kStages - 2> meaning "tile j has landed".
  constexpr int kStages = C::kStages;
  const int num_kv_tiles = (kv_end + kBlockN - 1) / kBlockN;
  const int j0 = kOptions ? kv_first / kBlockN : 0;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (j0 + st < num_kv_tiles) load_kv(j0 + st, st);
    cp_async_commit();
  }

  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, thread in group
  constexpr int kMTiles = C::kMTiles;
  const int wrow = warp * 16 * kMTiles;  // the warp's first row in the tile
  const float qk_scale = p.scale * kLog2e * p.k_scale;  // k_scale: 1 but for fp8
  const int warp_pos = first_pos + m0 + wrow;  // cache position of the warp's first row
  const int warp_last_pos = warp_pos + 16 * kMTiles - 1;
  // With a window, keys before warp_first_key are hidden from every row of the warp, and a key
  // at or before row_pos - window from that row.
  const int warp_first_key = window > 0 ? warp_pos - window + 1 : 0;
  const int warp_last_first_key = window > 0 ? warp_last_pos - window + 1 : 0;

  float o[kMTiles][C::kOTiles][4];
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int i = 0; i < C::kOTiles; ++i) o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.f;
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  for (int j = j0; j < num_kv_tiles; ++j) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (j + kStages - 1 < num_kv_tiles) load_kv(j + kStages - 1, (j - j0 + kStages - 1) % kStages);
    cp_async_commit();

    const int buf = (j - j0) % kStages;
    const T* k_s = kv_s + (C::kFp8 ? 0 : buf * 2 * kBlockN * kStride);
    if constexpr (C::kFp8) {
      convert_kv(buf);
      __syncthreads();
    }
    const T* v_s = k_s + kBlockN * kStride;

    // A warp whose rows all come before the tile's first key (or whose windows all start past its
    // last) would only mask all of it: it skips the math (warp-uniform), which the causal
    // diagonal's last tiles leave to the later warps.
    if (j * kBlockN <= warp_last_pos && (!kOptions || (j + 1) * kBlockN > warp_first_key)) {
      float s[kMTiles][C::kSTiles][4];
      warp_qk<C>(s, q_s + wrow * kStride, k_s, lane);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int n = 0; n < C::kSTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][n][e] = soft_cap(s[mi][n][e] * qk_scale, softcap);
        }
      }
      // Causal mask: only a tile reaching past the warp's first row position, or past kv_end,
      // needs it (for a long prompt, the diagonal and the last tiles; the test is warp-uniform);
      // the window's: only a tile starting before the warp's last row's first key.
      if ((j + 1) * kBlockN - 1 > warp_pos || (j + 1) * kBlockN > kv_end ||
          (kOptions && j * kBlockN < warp_last_first_key)) {
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
          for (int n = 0; n < C::kSTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = j * kBlockN + n * 8 + 2 * t + (e & 1);
              const int row_pos = warp_pos + mi * 16 + g + 8 * (e / 2);  // this element's row
              if (key > row_pos || key >= kv_end || (kOptions && window > 0 && key <= row_pos - window)) {
                s[mi][n][e] = -INFINITY;
              }
            }
          }
        }
      }
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) online_softmax(s[mi], o[mi], row_max[mi], row_sum[mi]);
      warp_pv<C>(o, s, v_s, lane);
    }
    // The next iteration's barrier keeps its refill (and fp8 conversion) off the tile just read.
  }
  cp_async_wait<0>();  // only empty groups remain, or, with no tile to attend, the Q copy

  // Normalise and store the rows this tile owns, and their lse (natural units). Two values locate
  // the rows and the head is blockIdx.y read again: so the row maxima the lse keeps live past the
  // loop fit in registers at head size 128 over fp8 (q_start and head were spilled across it).
  const int first_row = q_start + m0 + wrow + g;   // the lane's first output row
  const int rows_left = q_len - (m0 + wrow + g);   // rows of this sequence from first_row on
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const RowTotal total = with_sink(kOptions ? p.sinks : nullptr, blockIdx.y, row_max[mi][h], sum);
      const float inv = total.l > 0.f ? p.v_scale * total.acc_factor / total.l : 0.f;  // v_scale: 1 but for fp8
      const int local = mi * 16 + 8 * h;
      if (local >= rows_left) continue;
      const int64_t row = first_row + local;
      if (t == 0 && p.lse != nullptr) p.lse[row * p.num_heads + blockIdx.y] = natural_lse(total.m, total.l);
      T* out = static_cast<T*>(p.out) + row * p.out_row_stride + int64_t(blockIdx.y) * p.out_head_stride;
#pragma unroll
      for (int i = 0; i < C::kOTiles; ++i) {
        const int d = i * 8 + 2 * t;
        if (d < p.head_size) {
          out[d] = from_float<T>(o[mi][i][2 * h] * inv);
          out[d + 1] = from_float<T>(o[mi][i][2 * h + 1] * inv);
        }
      }
    }
  }
}

template <typename T, typename Cache, int HEAD, int kWarps>
cudaError_t launch_typed(const AttentionParams& p, int32_t* offsets, cudaStream_t stream) {
  using C = PrefillConfig<T, Cache, HEAD, kWarps>;
  const bool options = p.window > 0 || p.softcap > 0.f || p.sinks != nullptr;
  const auto kernel = options ? paged_prefill_kernel<T, Cache, HEAD, kWarps, true>
                              : paged_prefill_kernel<T, Cache, HEAD, kWarps, false>;
  prefill_tile_offsets_kernel<C::kBlockM><<<1, kWarpSize, 0, stream>>>(p.query_start_loc, p.num_seqs,
                                                                       p.num_rows, offsets);
  // Opting in above 48 KiB of dynamic shared memory is per kernel and cheap; redo it each launch
  // rather than track devices.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(C::kSmemBytes));
  if (err != cudaSuccess) return err;
  // sum of ceil(q_len / kBlockM) <= num_tokens / kBlockM + num_seqs; surplus CTAs exit at once.
  const dim3 grid(ceil_div(p.num_rows, C::kBlockM) + p.num_seqs, p.num_heads);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, offsets);
  return cudaGetLastError();
}

// Every head size and CTA shape of one (query, cache) dtype pair: what one attention_prefill_*.cu
// file instantiates. At head size 64, 8-warp CTAs where the 128-row tiles (counted as if the
// tokens were one sequence) are fewer than the SMs: SmolLM2's 1k-token prefill, 72 CTAs on an
// H200's 132 SMs, ran 3% faster (34.9 against 35.9-36.2 us, docs/gpu/kernels_cuda_run9.json).
template <typename T, typename Cache>
cudaError_t launch_prefill_for_head(const AttentionParams& p, const PrefillWork& w, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_head_size(p.head_size, [&](auto head) {
    constexpr int kHead = decltype(head)::value;
    if constexpr (kHead == 64) {
      if (int64_t(ceil_div(p.num_rows, PrefillConfig<T, Cache, kHead, 8>::kBlockM)) * p.num_heads < w.num_sms) {
        err = launch_typed<T, Cache, kHead, 8>(p, w.tile_offsets, stream);
        return;
      }
    }
    err = launch_typed<T, Cache, kHead, 4>(p, w.tile_offsets, stream);
  });
  return err;
}

}  // namespace
}  // namespace cuda
}  // namespace kvpage
