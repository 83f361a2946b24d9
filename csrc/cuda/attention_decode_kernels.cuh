// Paged decode attention kernels (and the SIMT prefill path), fp32 math. Included only by the
// attention_decode_<cache>_<query>.cu files, each of which instantiates launch_decode for one
// (query dtype, cache dtype) pair, so the instantiations compile in parallel.
//
// One CTA serves one query row and up to GT query heads of one GQA group, so each K/V tile is
// read from memory once for the whole group. Its 128 threads form "token groups" of TPT lanes;
// a token group owns one token at a time, each lane loading 16-byte (or 8-byte, see
// DecodeConfig) vectors of that token's K and V row. Every token group keeps its own online
// softmax (running max, sum and accumulator) over the tokens it visits, so the main loop has no
// block-wide barrier; the groups' states are merged once at the end (warp shuffles, then shared
// memory). Long contexts split into fixed partitions (one CTA each) whose partial states a
// reduce kernel merges with max-logit / exp-sum weights, vLLM's v2 scheme. Logits live in the
// log2 domain (q is pre-scaled by scale * log2(e)) so every exponential is one exp2f.
//
// fp8 caches: K/V codes unpack to exact floats (device_utils.cuh); k_scale folds into q's
// pre-scale and v_scale into the final normalisation, so the loop does no extra multiplies.
#pragma once

#include <cfloat>

#include "attention_decode.h"
#include "device_utils.cuh"

namespace kvpage {
namespace cuda {
namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr float kLog2e = 1.4426950408889634f;

constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }
constexpr int cmin(int a, int b) { return a < b ? a : b; }

template <typename Cache, int HEAD, int GT>
struct DecodeConfig {
  // Bytes per K/V load. 16, except for fp8 with 8 heads per CTA: a 16-byte load holds 16 fp8
  // values, doubling a lane's share of q and of the accumulators (GT x 16 floats each), which
  // for GT = 8 no longer fits in registers; 8-byte loads keep that tile's share at 8.
  static constexpr int kLoadBytes = (sizeof(Cache) == 1 && GT > 4) ? 8 : 16;
  using Load = typename std::conditional<kLoadBytes == 16, uint4, uint2>::type;
  static constexpr int kVec = kLoadBytes / sizeof(Cache);   // elements per load
  static constexpr int kVecsPerRow = HEAD / kVec;           // loads in one K/V row
  static constexpr int kTpt = cmin(kWarpSize, next_pow2(kVecsPerRow));  // lanes per token
  static constexpr int kNv = (kVecsPerRow + kTpt - 1) / kTpt;         // loads per lane
  static constexpr int kGroupsPerWarp = kWarpSize / kTpt;
  static constexpr int kTokenGroups = kDecodeWarps * kGroupsPerWarp;
  // Tokens in flight per token group: enough bytes outstanding to cover DRAM latency, few
  // enough that q, the accumulators and the loads stay in registers. Half-width loads get
  // twice the tokens, so the bytes in flight stay the same.
  static constexpr int kUnroll = (GT <= 4 ? 4 : 2) * (16 / kLoadBytes);
};

struct RowRange {
  int seq;      // block-table row
  int kv_len;   // tokens visible to this query row, within the table row's capacity
};

// Where a query row reads from. Index data is untrusted here (range checks may be off):
// everything is clamped so no access leaves its tensor.
__device__ __forceinline__ RowRange row_range(const AttentionParams& p, int row) {
  const int64_t capacity = int64_t(p.max_blocks_per_seq) * p.block_size;
  RowRange r{row, 0};
  int64_t len;
  if (p.query_start_loc == nullptr) {
    len = p.seq_lens[row];
  } else {
    // Last sequence whose start is <= row (binary search; query_start_loc is non-decreasing
    // when valid, and the search terminates on any data).
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.query_start_loc[mid] <= row) lo = mid; else hi = mid - 1;
    }
    r.seq = lo;
    const int64_t q_start = p.query_start_loc[lo], q_end = p.query_start_loc[lo + 1];
    len = (row >= q_start && row < q_end) ? int64_t(p.seq_lens[lo]) - (q_end - row) + 1 : 0;
  }
  r.kv_len = static_cast<int>(len < 0 ? 0 : (len > capacity ? capacity : len));
  return r;
}

// Online-softmax state of one query head: merge (m_o, l_o, acc_o) into (m, l, acc).
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m_o, float l_o,
                                            const float* acc_o) {
  const float m_new = fmaxf(m, m_o);
  if (m_new == -INFINITY) return;  // neither side has seen a token
  const float a = exp2f(m - m_new), b = exp2f(m_o - m_new);
  l = l * a + l_o * b;
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = acc[i] * a + acc_o[i] * b;
  m = m_new;
}

// T: query / out element; Cache: K/V cache element (T itself, or Fp8E4M3).
template <typename T, typename Cache, int HEAD, int GT>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const AttentionParams p, const DecodeWork w) {
  using C = DecodeConfig<Cache, HEAD, GT>;
  using Load = typename C::Load;
  constexpr int kVec = C::kVec, kNv = C::kNv, kTpt = C::kTpt, kUnroll = C::kUnroll;
  constexpr int kAcc = kNv * kVec;  // accumulator floats per lane per head

  const int row = blockIdx.x;
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + GT - 1) / GT;
  const int kv_head = blockIdx.y / chunks;
  const int head0 = kv_head * group + (blockIdx.y % chunks) * GT;
  const int num_heads_here = min(GT, group - (blockIdx.y % chunks) * GT);
  const int part = blockIdx.z;

  const RowRange rr = row_range(p, row);
  int begin = 0, end = rr.kv_len;
  if (w.partition_size > 0) {
    begin = part * w.partition_size;
    if (begin >= rr.kv_len) return;  // this row has fewer partitions; the reduce skips it
    end = min(end, begin + w.partition_size);
  }

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int sub = lane % kTpt;  // lane within the token group
  const int token_group = warp * C::kGroupsPerWarp + lane / kTpt;
  const int vecs = p.head_size / kVec;  // runtime head size may be below HEAD (masked lanes)

  // q for every head of the tile, only the dims this lane owns, pre-scaled to the log2 domain
  // and by k_scale (a key's value is its unpacked element times k_scale).
  float q[GT][kAcc];
  const float qscale = p.scale * kLog2e * p.k_scale;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const T* qh = static_cast<const T*>(p.query) + row * p.q_row_stride + (head0 + g) * p.q_head_stride;
#pragma unroll
    for (int i = 0; i < kNv; ++i) {
      const int v = sub + i * kTpt;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        q[g][i * kVec + e] = (g < num_heads_here && v < vecs) ? to_float(qh[v * kVec + e]) * qscale : 0.f;
      }
    }
  }

  float m[GT], l[GT], acc[GT][kAcc];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[g][i] = 0.f;
  }

  const int32_t* table = p.block_tables + int64_t(rr.seq) * p.max_blocks_per_seq;
  const int log2_bs = __ffs(p.block_size) - 1;  // block_size is a power of two
  const char* kc = static_cast<const char*>(p.key_cache);
  const char* vc = static_cast<const char*>(p.value_cache);
  const int64_t row_bytes = int64_t(p.head_size) * sizeof(Cache);

  // The trip count is uniform across the CTA (shuffles below need every lane); token validity
  // only masks data.
  for (int base = begin; base < end; base += C::kTokenGroups * kUnroll) {
    Load kv[kUnroll][kNv], vv[kUnroll][kNv];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // At step u the token groups of a warp take consecutive tokens: contiguous rows of a tile.
      const int t = base + u * C::kTokenGroups + token_group;
      const int block = t < end ? __ldg(table + (t >> log2_bs)) : -1;
      valid[u] = block >= 0 && block < p.num_blocks;
      const int64_t row_offset =
          ((int64_t(valid[u] ? block : 0) * p.num_kv_heads + kv_head) * p.block_size +
           (t & (p.block_size - 1))) * row_bytes;
#pragma unroll
      for (int i = 0; i < kNv; ++i) {
        const int v = sub + i * kTpt;
        const bool on = valid[u] && v < vecs;
        kv[u][i] = on ? load_stream<Load>(kc + row_offset + v * C::kLoadBytes) : Load{};
        vv[u][i] = on ? load_stream<Load>(vc + row_offset + v * C::kLoadBytes) : Load{};
      }
    }

    float s[kUnroll][GT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float k[kAcc];
#pragma unroll
      for (int i = 0; i < kNv; ++i) unpack<Cache>(kv[u][i], k + i * kVec);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kAcc; ++i) dot = fmaf(q[g][i], k[i], dot);
#pragma unroll
        for (int off = kTpt / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        s[u][g] = valid[u] ? dot : -INFINITY;
      }
    }

    // One rescale per kUnroll tokens: the running max moves to the max over the step, and s
    // becomes the step's probabilities (all 0 while nothing is visible yet).
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, s[u][g]);
      if (m_new == -INFINITY) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) s[u][g] = 0.f;
        continue;
      }
      const float alpha = exp2f(m[g] - m_new);
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[g][i] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][g] = exp2f(s[u][g] - m_new);
        l[g] += s[u][g];
      }
      m[g] = m_new;
    }
    // acc += p V, each V row unpacked once for all GT heads (unpacking is a large share of the
    // loop's instructions for fp8 and 16-bit caches).
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v[kAcc];
#pragma unroll
      for (int i = 0; i < kNv; ++i) unpack<Cache>(vv[u][i], v + i * kVec);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[g][i] = fmaf(s[u][g], v[i], acc[g][i]);
      }
    }
  }

  // Merge the token groups of each warp (lanes that own the same dims differ in bits >= kTpt).
#pragma unroll
  for (int off = kTpt; off < kWarpSize; off *= 2) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float acc_o[kAcc];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc_o[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], off);
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[g], off);
      merge_state<kAcc>(m[g], l[g], acc[g], m_o, l_o, acc_o);
    }
  }

  // Then the warps, through shared memory.
  __shared__ float s_acc[kDecodeWarps][GT][HEAD];
  __shared__ float s_m[kDecodeWarps][GT], s_l[kDecodeWarps][GT];
  if (lane < kTpt) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      if (lane == 0) s_m[warp][g] = m[g], s_l[warp][g] = l[g];
#pragma unroll
      for (int i = 0; i < kNv; ++i) {
        const int v = sub + i * kTpt;
        if (v < C::kVecsPerRow) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) s_acc[warp][g][v * kVec + e] = acc[g][i * kVec + e];
        }
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < num_heads_here * p.head_size; idx += kDecodeThreads) {
    const int g = idx / p.head_size, d = idx % p.head_size;
    float m_all = -INFINITY;
#pragma unroll
    for (int wi = 0; wi < kDecodeWarps; ++wi) m_all = fmaxf(m_all, s_m[wi][g]);
    float l_all = 0.f, o = 0.f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int wi = 0; wi < kDecodeWarps; ++wi) {
        const float wgt = exp2f(s_m[wi][g] - m_all);
        l_all += s_l[wi][g] * wgt;
        o += s_acc[wi][g][d] * wgt;
      }
    }
    const int head = head0 + g;
    // v_scale turns the weighted sum of unpacked values into one of values (1 but for fp8);
    // partials carry it too, so the reduce needs no dtype knowledge.
    if (w.partition_size > 0) {
      const int64_t slot = (int64_t(row) * p.num_heads + head) * w.max_partitions + part;
      w.tmp_out[slot * p.head_size + d] = o * p.v_scale;
      if (d == 0) w.tmp_max[slot] = m_all, w.tmp_sum[slot] = l_all;
    } else {
      T* out = static_cast<T*>(p.out) + row * p.out_row_stride + head * p.out_head_stride;
      out[d] = from_float<T>(l_all > 0.f ? o / l_all * p.v_scale : 0.f);
    }
  }
}

// Merges a row's partitions: weights 2^(m_p - max) rescale each partial sum and accumulator.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_reduce_kernel(const AttentionParams p, const DecodeWork w) {
  extern __shared__ float s_weight[];  // [max_partitions]
  const int row = blockIdx.x, head = blockIdx.y;
  const int num_parts = (row_range(p, row).kv_len + w.partition_size - 1) / w.partition_size;
  const int64_t slot0 = (int64_t(row) * p.num_heads + head) * w.max_partitions;

  float m_all = -INFINITY;
  for (int i = 0; i < num_parts; ++i) m_all = fmaxf(m_all, w.tmp_max[slot0 + i]);
  for (int i = threadIdx.x; i < num_parts; i += blockDim.x) {
    s_weight[i] = m_all == -INFINITY ? 0.f : exp2f(w.tmp_max[slot0 + i] - m_all);
  }
  __syncthreads();
  float l_all = 0.f;
  for (int i = 0; i < num_parts; ++i) l_all += w.tmp_sum[slot0 + i] * s_weight[i];
  const float inv = l_all > 0.f ? 1.f / l_all : 0.f;

  T* out = static_cast<T*>(p.out) + row * p.out_row_stride + head * p.out_head_stride;
  for (int d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < num_parts; ++i) o += w.tmp_out[(slot0 + i) * p.head_size + d] * s_weight[i];
    out[d] = from_float<T>(o * inv);
  }
}

template <typename T, typename Cache, int HEAD, int GT>
cudaError_t launch_decode_tile(const AttentionParams& p, const DecodeWork& w, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.num_rows, p.num_kv_heads * ((group + GT - 1) / GT),
                  w.partition_size > 0 ? w.max_partitions : 1);
  paged_decode_kernel<T, Cache, HEAD, GT><<<grid, kDecodeThreads, 0, stream>>>(p, w);
  if (w.partition_size > 0) {
    const size_t smem = sizeof(float) * w.max_partitions;
    if (smem > 48 * 1024) {
      cudaFuncSetAttribute(paged_decode_reduce_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
    }
    paged_decode_reduce_kernel<T><<<dim3(p.num_rows, p.num_heads), kDecodeThreads, smem, stream>>>(p, w);
  }
  return cudaGetLastError();
}

// Every head size and GQA tile of one (query, cache) dtype pair: what one attention_decode_*.cu
// file instantiates.
template <typename T, typename Cache>
cudaError_t launch_decode_for_head_and_tile(const AttentionParams& p, const DecodeWork& w,
                                            cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_head_size(p.head_size, [&](auto head) {
    dispatch_group_tile(p.num_heads / p.num_kv_heads, [&](auto gt) {
      err = launch_decode_tile<T, Cache, decltype(head)::value, decltype(gt)::value>(p, w, stream);
    });
  });
  return err;
}

}  // namespace
}  // namespace cuda
}  // namespace kvpage
