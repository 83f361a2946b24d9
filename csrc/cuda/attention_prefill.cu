// Paged varlen causal prefill, FlashAttention-2 style on tensor cores (fp16 / bf16 caches with
// queries of the same dtype, sm_80+; the other caches prefill through attention_decode).
//
// One CTA takes a tile of 64 query tokens of one sequence and one query head; its 4 warps own
// 16 query rows each. K/V tiles of kBlockN cache positions are gathered through the block table
// into shared memory with cp.async, double-buffered so the next tile's gather overlaps this
// tile's math. S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32 accumulators; the
// softmax is online (running max and sum per row, in registers). Query position i of a sequence
// with q_len queries and seq_len cached tokens is seq_len - q_len + i and sees positions <= it,
// which covers plain prefill, chunked prefill and prefix-cache hits alike.
//
// The (sequence, tile) of a CTA comes from a prefix sum of each sequence's tile count, computed
// on the device by a one-warp kernel, so launching needs no host copy of query_start_loc.
#include "device_utils.cuh"

namespace kvpage {
namespace cuda {
namespace {

constexpr int kPrefillThreads = 128;
constexpr int kBlockM = 64;  // query rows per CTA: 4 warps x 16
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int HEAD>
struct PrefillConfig {
  static constexpr int kBlockN = HEAD <= 128 ? 64 : 32;  // keeps O (HEAD/2 floats/lane) + S in registers
  static constexpr int kStride = HEAD + 8;  // padded smem row: conflict-free fragment loads
  static constexpr int kChunksPerRow = HEAD / 8;  // 16-byte chunks
  static constexpr int kKeySteps = HEAD / 16;      // k-steps of S = Q K^T
  static constexpr int kSTiles = kBlockN / 8;      // n-tiles of S
  static constexpr int kOTiles = HEAD / 8;         // n-tiles of O
  static constexpr size_t kSmemBytes = size_t(kBlockM + 4 * kBlockN) * kStride * sizeof(T);
};

// Tile offsets: offsets[s] = sum over sequences before s of ceil(q_len / kBlockM).
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

template <typename T, int HEAD>
__global__ void __launch_bounds__(kPrefillThreads)
    paged_prefill_kernel(const AttentionParams p, const int32_t* __restrict__ tile_offsets) {
  using C = PrefillConfig<T, HEAD>;
  constexpr int kBlockN = C::kBlockN, kStride = C::kStride, kCpr = C::kChunksPerRow;

  // Which (sequence, query tile): last s with tile_offsets[s] <= blockIdx.x.
  const int tile = blockIdx.x;
  if (tile >= tile_offsets[p.num_seqs]) return;
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

  const int head = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* kv_s = q_s + kBlockM * kStride;  // [2 buffers][K, V][kBlockN][kStride]

  const int tid = threadIdx.x;
  const int chunks = p.head_size / 8;  // runtime head size may be below HEAD: zero-filled

  // Q tile: rows past q_len and dims past head_size are zeros.
  {
    const T* qbase = static_cast<const T*>(p.query) + int64_t(head) * p.q_head_stride;
    for (int idx = tid; idx < kBlockM * kCpr; idx += kPrefillThreads) {
      const int r = idx / kCpr, c = idx % kCpr;
      const bool valid = m0 + r < q_len && c < chunks;
      const T* src = valid ? qbase + int64_t(q_start + m0 + r) * p.q_row_stride + c * 8 : qbase;
      cp_async16(q_s + r * kStride + c * 8, src, valid);
    }
  }

  const int32_t* table = p.block_tables + int64_t(seq) * p.max_blocks_per_seq;
  const int log2_bs = __ffs(p.block_size) - 1;
  const T* kcache = static_cast<const T*>(p.key_cache);
  const T* vcache = static_cast<const T*>(p.value_cache);

  // Gathers cache positions [j * kBlockN, +kBlockN) of this KV head into buffer `buf`.
  auto load_kv = [&](int j, int buf) {
    T* k_dst = kv_s + buf * 2 * kBlockN * kStride;
    T* v_dst = k_dst + kBlockN * kStride;
    for (int idx = tid; idx < kBlockN * kCpr; idx += kPrefillThreads) {
      const int r = idx / kCpr, c = idx % kCpr;
      const int pos = j * kBlockN + r;
      const int block = pos < kv_end ? __ldg(table + (pos >> log2_bs)) : -1;
      const bool valid = block >= 0 && block < p.num_blocks && c < chunks;
      const int64_t off =
          valid ? ((int64_t(block) * p.num_kv_heads + kv_head) * p.block_size + (pos & (p.block_size - 1))) *
                          p.head_size + c * 8
                : 0;
      cp_async16(k_dst + r * kStride + c * 8, kcache + off, valid);
      cp_async16(v_dst + r * kStride + c * 8, vcache + off, valid);
    }
  };

  const int num_kv_tiles = (kv_end + kBlockN - 1) / kBlockN;
  if (num_kv_tiles > 0) load_kv(0, 0);
  cp_async_commit();  // group 0: Q (+ first K/V tile)

  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, thread in group
  const int wrow = warp * 16;
  const float qk_scale = p.scale * kLog2e;
  // Cache positions visible to this lane's two rows (g and g + 8).
  const int row_pos[2] = {first_pos + m0 + wrow + g, first_pos + m0 + wrow + g + 8};

  float o[C::kOTiles][4];
#pragma unroll
  for (int i = 0; i < C::kOTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  for (int j = 0; j < num_kv_tiles; ++j) {
    if (j + 1 < num_kv_tiles) {
      load_kv(j + 1, (j + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();  // everything but the tile just issued has landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const T* k_s = kv_s + (j & 1) * 2 * kBlockN * kStride;
    const T* v_s = k_s + kBlockN * kStride;

    // S = Q K^T for this warp's 16 rows x kBlockN keys.
    float s[C::kSTiles][4];
#pragma unroll
    for (int n = 0; n < C::kSTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < C::kKeySteps; ++kk) {
      const T* qa = q_s + (wrow + g) * kStride + kk * 16 + 2 * t;
      uint32_t a[4];
      a[0] = *reinterpret_cast<const uint32_t*>(qa);
      a[1] = *reinterpret_cast<const uint32_t*>(qa + 8 * kStride);
      a[2] = *reinterpret_cast<const uint32_t*>(qa + 8);
      a[3] = *reinterpret_cast<const uint32_t*>(qa + 8 * kStride + 8);
#pragma unroll
      for (int n = 0; n < C::kSTiles; ++n) {
        const T* kb = k_s + (n * 8 + g) * kStride + kk * 16 + 2 * t;
        mma_16816<T>(s[n], a, *reinterpret_cast<const uint32_t*>(kb),
                     *reinterpret_cast<const uint32_t*>(kb + 8));
      }
    }

    // Causal mask + online softmax. Lane holds rows g (e = 0, 1) and g + 8 (e = 2, 3).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < C::kSTiles; ++n) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int key = j * kBlockN + n * 8 + 2 * t + (e & 1);
          const bool visible = key <= row_pos[h] && key < kv_end;
          s[n][e] = visible ? s[n][e] * qk_scale : -INFINITY;
          mx = fmaxf(mx, s[n][e]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[h], mx);
      // A row with nothing visible yet keeps a zero base so exp2f(-inf - base) is a clean 0.
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(row_max[h] - base);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < C::kSTiles; ++n) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[n][e] = exp2f(s[n][e] - base);
          sum += s[n][e];
        }
      }
      row_sum[h] = row_sum[h] * alpha + sum;  // lane-partial; the 4 lanes of a row add up at the end
      row_max[h] = m_new;
#pragma unroll
      for (int i = 0; i < C::kOTiles; ++i) o[i][2 * h] *= alpha, o[i][2 * h + 1] *= alpha;
    }

    // O += P V. Two S n-tiles form one A fragment (FA2's register reuse); V fragments come
    // from row-major smem through ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      const T* vrow = v_s + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
      for (int d = 0; d < C::kOTiles / 2; ++d) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vrow + d * 16);
        mma_16816<T>(o[2 * d], a, b[0], b[1]);
        mma_16816<T>(o[2 * d + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's gather overwrites the buffer just read
  }
  cp_async_wait<0>();  // no tile to attend (q rows see nothing): still drain the Q copy

  // Normalise and store the rows this tile owns.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int r = m0 + wrow + g + 8 * h;
    if (r >= q_len) continue;
    T* out = static_cast<T*>(p.out) + int64_t(q_start + r) * p.out_row_stride + int64_t(head) * p.out_head_stride;
#pragma unroll
    for (int i = 0; i < C::kOTiles; ++i) {
      const int d = i * 8 + 2 * t;
      if (d < p.head_size) {
        out[d] = from_float<T>(o[i][2 * h] * inv);
        out[d + 1] = from_float<T>(o[i][2 * h + 1] * inv);
      }
    }
  }
}

template <typename T, int HEAD>
cudaError_t launch_typed(const AttentionParams& p, int32_t* offsets, cudaStream_t stream) {
  using C = PrefillConfig<T, HEAD>;
  prefill_tile_offsets_kernel<<<1, kWarpSize, 0, stream>>>(p.query_start_loc, p.num_seqs, p.num_rows,
                                                           offsets);
  // Opting in above 48 KiB of dynamic shared memory is per kernel and cheap; redo it each launch
  // rather than track devices.
  cudaError_t err = cudaFuncSetAttribute(paged_prefill_kernel<T, HEAD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(C::kSmemBytes));
  if (err != cudaSuccess) return err;
  // sum of ceil(q_len / kBlockM) <= num_tokens / kBlockM + num_seqs; surplus CTAs exit at once.
  const dim3 grid(ceil_div(p.num_rows, kBlockM) + p.num_seqs, p.num_heads);
  paged_prefill_kernel<T, HEAD><<<grid, kPrefillThreads, C::kSmemBytes, stream>>>(p, offsets);
  return cudaGetLastError();
}

}  // namespace

// fp16 / bf16 caches only. fp32 and fp8 caches prefill through the SIMT decode kernel (one CTA
// per query token, single pass): this kernel stages K/V with cp.async straight from the cache
// into the mma operand layout, which fp8 codes would first need dequantising out of. The SIMT
// path re-reads a sequence's K/V per query token (mostly from L2), so long fp8 prefills are
// much slower than fp16 ones: a known cost until an fp8-aware tensor-core prefill exists.
bool prefill_uses_tensor_cores(const AttentionParams& p) {
  return p.cache_dtype == p.dtype && (p.dtype == DType::kHalf || p.dtype == DType::kBFloat16);
}

cudaError_t launch_paged_prefill(const AttentionParams& p, int32_t* workspace, cudaStream_t stream) {
  if (!prefill_uses_tensor_cores(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0 || p.num_seqs == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same<T, float>::value) {
      dispatch_head_size(p.head_size, [&](auto head) {
        err = launch_typed<T, decltype(head)::value>(p, workspace, stream);
      });
    }
  });
  return err;
}

}  // namespace cuda
}  // namespace kvpage
