// Paged decode attention kernels (and the SIMT prefill path), fp32 math. Included only by the
// attention_decode_<cache>_<query>.cu files, each of which instantiates launch_decode for one
// (query dtype, cache dtype) pair, so the instantiations compile in parallel.
//
// One CTA serves one query row and up to GT query heads of one GQA group, so each K/V tile is
// read from memory once for the whole group. K/V stream through a ring of shared-memory stages
// filled by cp.async (one barrier per stage). Its 128 threads form "token groups" of TPT lanes;
// a token group takes one staged token at a time, each lane reading 16-byte (or 8-byte, see
// DecodeConfig) vectors of that token's K and V row. Every token group keeps its own online
// softmax (running max, sum and accumulator) over the tokens it visits; the groups' states are
// merged once at the end (warp shuffles, then shared memory). Long contexts split into fixed partitions (one CTA each) whose partial states a
// reduce kernel merges with max-logit / exp-sum weights, vLLM's v2 scheme. Logits live in the
// log2 domain (q is pre-scaled by scale * log2(e)) so every exponential is one exp2f.
//
// fp8 caches: K/V codes unpack to exact floats (device_utils.cuh); k_scale folds into q's
// pre-scale and v_scale into the final normalisation, so the loop does no extra multiplies.
#pragma once

#include <atomic>
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
constexpr int cmax(int a, int b) { return a > b ? a : b; }

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
  // Tokens a token group takes per compute step (one online-softmax rescale each): few enough
  // that q, the accumulators and the step's K/V vectors stay in registers. Half-width loads get
  // twice the tokens, so a step covers the same bytes.
  static constexpr int kUnroll = (GT <= 4 ? 4 : 2) * (16 / kLoadBytes);
  static constexpr int kStepTokens = kTokenGroups * kUnroll;  // tokens of one compute step

  // K/V stream through shared memory in a ring of kStages stages filled by cp.async, so about
  // (kStages - 1) stages of every resident CTA are in flight while it computes: enough bytes
  // outstanding per SM to cover DRAM latency, with no registers held for them. A stage is a
  // whole number of steps, about 16 KiB of K + V; the ring about 48 KiB, so 4 CTAs fit an SM
  // (a 64 KiB ring, 3 per SM, ran grids of ~4 CTAs per SM in two waves on an H200).
  static constexpr int kRowBytes = HEAD * int(sizeof(Cache));  // a K or V row's shared-memory slot
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kStageSteps = cmax(1, 16384 / (2 * kRowBytes * kStepTokens));
  static constexpr int kStageTokens = kStepTokens * kStageSteps;
  static constexpr int kStageBytes = 2 * kStageTokens * kRowBytes;
  static constexpr int kStages = cmin(3, cmax(2, 49152 / kStageBytes));
  // The ring, then a validity byte per staged token (padded to 16 bytes).
  static constexpr int kValidOffset = kStages * kStageBytes;
  static constexpr int kSmemBytes = kValidOffset + (kStages * kStageTokens + 15) / 16 * 16;
  // After the loop the ring holds the warps' states for the final merge.
  static constexpr int kMergeBytes = int(sizeof(float)) * kDecodeWarps * GT * (HEAD + 2);
  static_assert(kMergeBytes <= kValidOffset, "the merge reuses the K/V ring");
  static_assert(kRowBytes % 16 == 0, "rows are whole 16-byte chunks");
  // Resident CTAs per SM the register budget aims at: 4 (at most 128 registers) where q and
  // the accumulators take at most 64 floats per lane and a row takes one load per lane; GQA
  // tiles of 8, fp8's wide loads and fp32 rows of two loads a lane hold more (they spilled at
  // 128) and settle for 2.
  static constexpr int kMinBlocksPerSm = GT <= 4 && kNv == 1 && GT * kVec <= 32 ? 4 : 2;
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

// One compute step of a token group: kUnroll tokens (K rows kv, V rows vv, this lane's share)
// folded into the online-softmax state (m, l, acc) of each of the GT query heads.
template <typename Cache, int HEAD, int GT, typename C = DecodeConfig<Cache, HEAD, GT>,
          int kAcc = C::kNv * C::kVec>
__device__ __forceinline__ void attend_step(const float (&q)[GT][kAcc],
                                            const typename C::Load (&kv)[C::kUnroll][C::kNv],
                                            const typename C::Load (&vv)[C::kUnroll][C::kNv],
                                            const bool (&valid)[C::kUnroll], float (&m)[GT], float (&l)[GT],
                                            float (&acc)[GT][kAcc]) {
  constexpr int kUnroll = C::kUnroll, kNv = C::kNv, kVec = C::kVec, kTpt = C::kTpt;
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
    if (m_new > m[g]) {  // once the running max settles, most steps skip the (exact: x1) rescale
      const float alpha = exp2f(m[g] - m_new);
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[g][i] *= alpha;
    }
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

// T: query / out element; Cache: K/V cache element (T itself, or Fp8E4M3).
template <typename T, typename Cache, int HEAD, int GT>
__global__ void __launch_bounds__(kDecodeThreads, (DecodeConfig<Cache, HEAD, GT>::kMinBlocksPerSm))
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
  const int row_chunks = static_cast<int>(row_bytes / 16);

  extern __shared__ __align__(16) unsigned char smem[];
  bool* staged_valid = reinterpret_cast<bool*>(smem + C::kValidOffset);  // [kStages][kStageTokens]

  // Each thread copies 16-byte chunks of a stage (consecutive threads, consecutive chunks of a
  // row). The block ids its chunks need are read one stage ahead (fetch_blocks), so issuing a
  // stage's copies never waits on a block-table load.
  constexpr int kChunks = C::kStageTokens * C::kChunksPerRow;
  constexpr int kChunksPerThread = (kChunks + kDecodeThreads - 1) / kDecodeThreads;
  auto fetch_blocks = [&](int first, int (&blocks)[kChunksPerThread]) {
#pragma unroll
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int idx = threadIdx.x + k * kDecodeThreads;
      const int t = first + idx / C::kChunksPerRow;
      blocks[k] = idx < kChunks && t < end ? __ldg(table + (t >> log2_bs)) : -1;
    }
  };
  // Issues the copies of tokens [first, first + kStageTokens) into ring slot `stage`. Tokens
  // past `end` or with a block id outside the cache are zero-filled and marked invalid.
  auto load_stage = [&](int first, int stage, const int (&blocks)[kChunksPerThread]) {
    unsigned char* k_dst = smem + stage * C::kStageBytes;
    unsigned char* v_dst = k_dst + C::kStageTokens * C::kRowBytes;
#pragma unroll
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int idx = threadIdx.x + k * kDecodeThreads;
      if (kChunks % kDecodeThreads != 0 && idx >= kChunks) break;
      const int r = idx / C::kChunksPerRow, c = idx % C::kChunksPerRow;
      const int t = first + r;
      const bool valid = blocks[k] >= 0 && blocks[k] < p.num_blocks;
      const bool on = valid && c < row_chunks;
      const int64_t offset =
          on ? ((int64_t(blocks[k]) * p.num_kv_heads + kv_head) * p.block_size + (t & (p.block_size - 1))) *
                       row_bytes + c * 16
             : 0;
      cp_async16(k_dst + r * C::kRowBytes + c * 16, kc + offset, on);
      cp_async16(v_dst + r * C::kRowBytes + c * 16, vc + offset, on);
      if (c == 0) staged_valid[stage * C::kStageTokens + r] = valid;
    }
  };

  // The ring: stages 0 .. kStages - 2 in flight before the loop; iteration j waits for stage j,
  // then refills the slot stage j - 1 used (every thread is past it: the barrier) with stage
  // j + kStages - 1. One commit group per stage, empty ones included, keeps wait<kStages - 2>
  // meaning "stage j has landed". The trip count is uniform across the CTA.
  const int num_stages = (end - begin + C::kStageTokens - 1) / C::kStageTokens;
  int blocks[kChunksPerThread];
#pragma unroll
  for (int st = 0; st < C::kStages - 1; ++st) {
    fetch_blocks(begin + st * C::kStageTokens, blocks);
    if (st < num_stages) load_stage(begin + st * C::kStageTokens, st, blocks);
    cp_async_commit();
  }
  fetch_blocks(begin + (C::kStages - 1) * C::kStageTokens, blocks);
  for (int j = 0; j < num_stages; ++j) {
    cp_async_wait<C::kStages - 2>();
    __syncthreads();
    const int refill = j + C::kStages - 1;
    if (refill < num_stages) load_stage(begin + refill * C::kStageTokens, refill % C::kStages, blocks);
    cp_async_commit();
    fetch_blocks(begin + (refill + 1) * C::kStageTokens, blocks);  // lands while this stage computes

    const int stage = j % C::kStages;
    const unsigned char* k_src = smem + stage * C::kStageBytes;
    const unsigned char* v_src = k_src + C::kStageTokens * C::kRowBytes;
    const bool* valid_src = staged_valid + stage * C::kStageTokens;
#pragma unroll
    for (int step = 0; step < C::kStageSteps; ++step) {
      Load kv[kUnroll][kNv], vv[kUnroll][kNv];
      bool valid[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        // At step u the token groups of a warp take consecutive tokens: contiguous rows.
        const int r = step * C::kStepTokens + u * C::kTokenGroups + token_group;
        valid[u] = valid_src[r];
#pragma unroll
        for (int i = 0; i < kNv; ++i) {
          const int v = sub + i * kTpt;
          const bool on = v < vecs;
          kv[u][i] = on ? *reinterpret_cast<const Load*>(k_src + r * C::kRowBytes + v * C::kLoadBytes) : Load{};
          vv[u][i] = on ? *reinterpret_cast<const Load*>(v_src + r * C::kRowBytes + v * C::kLoadBytes) : Load{};
        }
      }
      attend_step<Cache, HEAD, GT>(q, kv, vv, valid, m, l, acc);
    }
  }
  cp_async_wait<0>();  // only empty groups can remain; the ring becomes the merge's scratch
  allow_dependent_launch();  // the reduce may start launching; it waits for our partials
  __syncthreads();

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
  auto s_acc = reinterpret_cast<float(*)[GT][HEAD]>(smem);  // [kDecodeWarps][GT][HEAD]
  auto s_m = reinterpret_cast<float(*)[GT]>(smem + sizeof(float) * kDecodeWarps * GT * HEAD);
  auto s_l = s_m + kDecodeWarps;
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
// The partitions' maxima and sums go to shared memory in one parallel pass, so no thread walks
// a chain of dependent global loads; each output element sums its partials 4 at a time.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_reduce_kernel(const AttentionParams p, const DecodeWork w) {
  extern __shared__ float s_part[];  // [2][max_partitions]: maxima, then weights; sums
  wait_for_prerequisite_grid();  // launched overlapping the decode kernel's tail
  float* s_weight = s_part;
  float* s_sum = s_part + w.max_partitions;
  const int row = blockIdx.x, head = blockIdx.y;
  const int num_parts = (row_range(p, row).kv_len + w.partition_size - 1) / w.partition_size;
  const int64_t slot0 = (int64_t(row) * p.num_heads + head) * w.max_partitions;

  for (int i = threadIdx.x; i < num_parts; i += blockDim.x) {
    s_weight[i] = w.tmp_max[slot0 + i], s_sum[i] = w.tmp_sum[slot0 + i];
  }
  __syncthreads();
  float m_all = -INFINITY;
  for (int i = 0; i < num_parts; ++i) m_all = fmaxf(m_all, s_weight[i]);
  __syncthreads();  // every thread has its maximum before the maxima turn into weights
  for (int i = threadIdx.x; i < num_parts; i += blockDim.x) {
    s_weight[i] = m_all == -INFINITY ? 0.f : exp2f(s_weight[i] - m_all);
  }
  __syncthreads();
  float l_all = 0.f;
  for (int i = 0; i < num_parts; ++i) l_all += s_sum[i] * s_weight[i];
  const float inv = l_all > 0.f ? 1.f / l_all : 0.f;

  T* out = static_cast<T*>(p.out) + row * p.out_row_stride + head * p.out_head_stride;
  const float* partial = w.tmp_out + slot0 * p.head_size;
  for (int d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    int i = 0;
    for (; i + 4 <= num_parts; i += 4) {
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] += partial[int64_t(i + k) * p.head_size + d] * s_weight[i + k];
    }
    for (; i < num_parts; ++i) o[0] += partial[int64_t(i) * p.head_size + d] * s_weight[i];
    out[d] = from_float<T>((o[0] + o[1] + (o[2] + o[3])) * inv);
  }
}

// Launches kernel<<<grid, kDecodeThreads, smem, stream>>>(args...), with overlap (sm_90+ only)
// as a programmatic dependent of the kernel before it on the stream: its launch overlaps that
// kernel's last CTAs, a few microseconds of a small batch's decode.
template <typename... Params, typename... Args>
cudaError_t launch_overlapping(void (*kernel)(Params...), dim3 grid, size_t smem, cudaStream_t stream,
                               bool overlap, const Args&... args) {
#ifndef KVPAGE_CUDA_EMU
  if (overlap) {
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid, config.blockDim = dim3(kDecodeThreads), config.dynamicSmemBytes = smem;
    config.stream = stream, config.attrs = attribute, config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args...);
  }
#endif
  kernel<<<grid, kDecodeThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

template <typename T, typename Cache, int HEAD, int GT>
cudaError_t launch_decode_tile(const AttentionParams& p, const DecodeWork& w, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.num_rows, p.num_kv_heads * ((group + GT - 1) / GT),
                  w.partition_size > 0 ? w.max_partitions : 1);
  using C = DecodeConfig<Cache, HEAD, GT>;
  const auto kernel = paged_decode_kernel<T, Cache, HEAD, GT>;
  // The ring takes over 48 KiB of dynamic shared memory: an opt-in per kernel and device, once.
  static std::atomic<uint64_t> opted_in{0};  // a bit per device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
    if (err != cudaSuccess) return err;
    opted_in.fetch_or(bit, std::memory_order_relaxed);
  }
  kernel<<<grid, kDecodeThreads, C::kSmemBytes, stream>>>(p, w);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (w.partition_size > 0) {
    const size_t smem = 2 * sizeof(float) * w.max_partitions;
    if (smem > 48 * 1024) {
      cudaFuncSetAttribute(paged_decode_reduce_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
    }
    err = launch_overlapping(paged_decode_reduce_kernel<T>, dim3(p.num_rows, p.num_heads), smem, stream,
                             w.overlap_reduce, p, w);
    if (err != cudaSuccess) return err;
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
