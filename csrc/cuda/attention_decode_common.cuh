// What the two paged decode kernels share: the row's key range, the shared-memory ring that
// streams a KV head's K/V rows in with cp.async, the end-of-CTA merge of the warps' softmax
// states, and the reduce kernel that merges a row's partitions (vLLM's v2 scheme). The kernels
// are attention_decode_kernels.cuh (SIMT, every dtype) and attention_decode_mma.cuh (tensor
// cores, 16-bit GQA groups).
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

constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }
constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

struct RowRange {
  int seq;      // block-table row
  int kv_len;   // tokens up to and including this query row's position, within the table row's capacity
  int first;    // the first of them its sliding window lets it see (0 without one)
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
  r.first = p.window > 0 && r.kv_len > p.window ? r.kv_len - p.window : 0;
  return r;
}

// The CTA's place in the grid (x: query row, y: KV head and tile of up to GT of its query
// heads, z: partition) and the tokens [begin, end) it attends over: partitions tile the row's
// visible keys [range.first, kv_len), so a window's CTAs never read the table entries before it.
struct DecodeCta {
  int row, kv_head, head0, num_heads, part;
  RowRange range;
  int begin, end;
};

// false: the CTA's partition starts past its row's end (the reduce skips it).
template <int GT>
__device__ __forceinline__ bool decode_cta(const AttentionParams& p, const DecodeWork& w, DecodeCta& c) {
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + GT - 1) / GT;
  c.row = blockIdx.x;
  c.kv_head = blockIdx.y / chunks;
  c.head0 = c.kv_head * group + (blockIdx.y % chunks) * GT;
  c.num_heads = min(GT, group - (blockIdx.y % chunks) * GT);
  c.part = blockIdx.z;
  c.range = row_range(p, c.row);
  c.begin = c.range.first, c.end = c.range.kv_len;
  if (w.partition_size > 0) {
    c.begin += c.part * w.partition_size;
    if (c.begin >= c.range.kv_len) return false;
    c.end = min(c.end, c.begin + w.partition_size);
  }
  return true;
}

// K/V rows of one KV head, tokens [begin, end) of a row, streamed into a ring of kStages
// shared-memory stages by cp.async, so about kStages - 1 stages of every resident CTA are in
// flight while it computes, with no registers held for them. A stage is kStageTokens K rows then
// kStageTokens V rows, each in a slot of kSlotBytes (>= the row; a padded slot keeps ldmatrix
// conflict-free), then after the ring a validity byte per staged token. Tokens past `end` or
// with a block id outside the cache are zero-filled and marked invalid.
template <typename Cache, int HEAD, int kStageTokens, int kSlotBytes, int kStages>
struct KvRing {
  static constexpr int kTokens = kStageTokens;
  static constexpr int kNumStages = kStages;
  static constexpr int kChunksPerRow = HEAD * int(sizeof(Cache)) / 16;
  static constexpr int kStageBytes = 2 * kStageTokens * kSlotBytes;
  static constexpr int kValidOffset = kStages * kStageBytes;
  static constexpr int kSmemBytes = kValidOffset + (kStages * kStageTokens + 15) / 16 * 16;
  static constexpr int kChunks = kStageTokens * kChunksPerRow;
  static constexpr int kChunksPerThread = (kChunks + kDecodeThreads - 1) / kDecodeThreads;
  static_assert(HEAD * sizeof(Cache) % 16 == 0 && kSlotBytes % 16 == 0, "rows are whole 16-byte chunks");

  unsigned char* smem;
  const int32_t* table;
  const char* key_cache;
  const char* value_cache;
  int64_t row_bytes;
  int row_chunks, log2_block_size, block_size, num_blocks, num_kv_heads, kv_head, end;
  // The block ids of the next stage's chunks, read a stage ahead (fetch_blocks), so issuing a
  // stage's copies never waits on a block-table load.
  int blocks[kChunksPerThread];

  __device__ __forceinline__ KvRing(const AttentionParams& p, const DecodeCta& c, unsigned char* smem_base)
      : smem(smem_base),
        table(p.block_tables + int64_t(c.range.seq) * p.max_blocks_per_seq),
        key_cache(static_cast<const char*>(p.key_cache)),
        value_cache(static_cast<const char*>(p.value_cache)),
        row_bytes(int64_t(p.head_size) * sizeof(Cache)),
        row_chunks(static_cast<int>(int64_t(p.head_size) * sizeof(Cache) / 16)),
        log2_block_size(0),
        block_size(p.block_size),
        num_blocks(p.num_blocks),
        num_kv_heads(p.num_kv_heads),
        kv_head(c.kv_head),
        end(c.end) {
    while ((2 << log2_block_size) <= block_size) ++log2_block_size;  // block_size is a power of two
  }

  __device__ __forceinline__ const unsigned char* keys(int stage) const { return smem + stage * kStageBytes; }
  __device__ __forceinline__ const unsigned char* values(int stage) const {
    return keys(stage) + kStageTokens * kSlotBytes;
  }
  __device__ __forceinline__ const bool* valid(int stage) const {
    return reinterpret_cast<const bool*>(smem + kValidOffset) + stage * kStageTokens;
  }

  // Each thread copies 16-byte chunks of a stage: consecutive threads, consecutive chunks of a row.
  __device__ __forceinline__ void fetch_blocks(int first) {
#pragma unroll
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int idx = threadIdx.x + k * kDecodeThreads;
      const int t = first + idx / kChunksPerRow;
      blocks[k] = idx < kChunks && t < end ? __ldg(table + (t >> log2_block_size)) : -1;
    }
  }

  // Issues the copies of tokens [first, first + kStageTokens) into slot `stage` (blocks fetched).
  __device__ __forceinline__ void load_stage(int first, int stage) {
    unsigned char* k_dst = smem + stage * kStageBytes;
    unsigned char* v_dst = k_dst + kStageTokens * kSlotBytes;
    bool* valid_dst = reinterpret_cast<bool*>(smem + kValidOffset) + stage * kStageTokens;
#pragma unroll
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int idx = threadIdx.x + k * kDecodeThreads;
      if (kChunks % kDecodeThreads != 0 && idx >= kChunks) break;
      const int r = idx / kChunksPerRow, c = idx % kChunksPerRow;
      const int t = first + r;
      const bool valid = blocks[k] >= 0 && blocks[k] < num_blocks;
      const bool on = valid && c < row_chunks;
      const int64_t offset =
          on ? ((int64_t(blocks[k]) * num_kv_heads + kv_head) * block_size + (t & (block_size - 1))) * row_bytes +
                   c * 16
             : 0;
      cp_async16(k_dst + r * kSlotBytes + c * 16, key_cache + offset, on);
      cp_async16(v_dst + r * kSlotBytes + c * 16, value_cache + offset, on);
      if (c == 0) valid_dst[r] = valid;
    }
  }
};

// Runs the ring over [begin, ring.end): consume(stage) once per landed stage, in order, with the
// whole CTA. Stages 0 .. kStages - 2 are in flight before the loop; iteration j waits for stage
// j, then refills the slot stage j - 1 used (every thread is past it: the barrier) with stage
// j + kStages - 1. One commit group per stage, empty ones included, keeps wait<kStages - 2>
// meaning "stage j has landed". The trip count is uniform across the CTA. On return no copy is
// pending and every thread is past the last stage: the ring is free scratch.
template <typename Ring, typename Consume>
__device__ __forceinline__ void stream_kv(Ring& ring, int begin, Consume&& consume) {
  constexpr int kStages = Ring::kNumStages, stage_tokens = Ring::kTokens;
  static_assert(kStages >= 2, "a ring has at least two stages");
  const int num_stages = (ring.end - begin + stage_tokens - 1) / stage_tokens;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    ring.fetch_blocks(begin + st * stage_tokens);
    if (st < num_stages) ring.load_stage(begin + st * stage_tokens, st);
    cp_async_commit();
  }
  ring.fetch_blocks(begin + (kStages - 1) * stage_tokens);
  for (int j = 0; j < num_stages; ++j) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int refill = j + kStages - 1;
    if (refill < num_stages) ring.load_stage(begin + refill * stage_tokens, refill % kStages);
    cp_async_commit();
    ring.fetch_blocks(begin + (refill + 1) * stage_tokens);  // lands while this stage computes
    consume(j % kStages);
  }
  cp_async_wait<0>();  // only empty groups can remain
  allow_dependent_launch();  // the reduce may start launching; it waits for our partials
  __syncthreads();
}

// After the loop, each warp's softmax state per query head of the tile sits in shared memory
// (the ring's first bytes): acc [kDecodeWarps][GT][HEAD], then maxima and sums [kDecodeWarps][GT]
// (log2 domain). WarpStates names them.
template <int GT, int HEAD>
struct WarpStates {
  static constexpr int kBytes = int(sizeof(float)) * kDecodeWarps * GT * (HEAD + 2);
  float (*acc)[GT][HEAD];
  float (*max)[GT];
  float (*sum)[GT];
  __device__ __forceinline__ explicit WarpStates(unsigned char* smem)
      : acc(reinterpret_cast<float(*)[GT][HEAD]>(smem)),
        max(reinterpret_cast<float(*)[GT]>(smem + sizeof(float) * kDecodeWarps * GT * HEAD)),
        sum(max + kDecodeWarps) {}
};

// Merges the warps' states (written before a barrier) and stores the CTA's result: the output
// rows of its heads (single pass) or its partition's unnormalised partials.
template <typename T, int GT, int HEAD>
__device__ __forceinline__ void store_merged(const AttentionParams& p, const DecodeWork& w, const DecodeCta& c,
                                             const WarpStates<GT, HEAD>& s) {
  for (int idx = threadIdx.x; idx < c.num_heads * p.head_size; idx += kDecodeThreads) {
    const int g = idx / p.head_size, d = idx % p.head_size;
    float m_all = -INFINITY;
#pragma unroll
    for (int wi = 0; wi < kDecodeWarps; ++wi) m_all = fmaxf(m_all, s.max[wi][g]);
    float l_all = 0.f, o = 0.f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int wi = 0; wi < kDecodeWarps; ++wi) {
        const float wgt = exp2f(s.max[wi][g] - m_all);
        l_all += s.sum[wi][g] * wgt;
        o += s.acc[wi][g][d] * wgt;
      }
    }
    const int head = c.head0 + g;
    // v_scale turns the weighted sum of unpacked values into one of values (1 but for fp8);
    // partials carry it too, so the reduce needs no dtype knowledge.
    if (w.partition_size > 0) {
      const int64_t slot = (int64_t(c.row) * p.num_heads + head) * w.max_partitions + c.part;
      w.tmp_out[slot * p.head_size + d] = o * p.v_scale;
      if (d == 0) w.tmp_max[slot] = m_all, w.tmp_sum[slot] = l_all;
    } else {
      const RowTotal total = with_sink(p.sinks, head, m_all, l_all);
      T* out = static_cast<T*>(p.out) + c.row * p.out_row_stride + head * p.out_head_stride;
      out[d] = from_float<T>(total.l > 0.f ? o * total.acc_factor / total.l * p.v_scale : 0.f);
      if (d == 0 && p.lse != nullptr) p.lse[int64_t(c.row) * p.num_heads + head] = natural_lse(total.m, total.l);
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
  const RowRange range = row_range(p, row);
  const int num_parts = (range.kv_len - range.first + w.partition_size - 1) / w.partition_size;
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
  const RowTotal total = with_sink(p.sinks, head, m_all, l_all);
  const float inv = total.l > 0.f ? total.acc_factor / total.l : 0.f;
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[int64_t(row) * p.num_heads + head] = natural_lse(total.m, total.l);

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

// Launches Kernel over its grid (rows x KV heads and tiles of GT heads x partitions), then the
// reduce when the context is split.
template <typename T, int GT, void (*Kernel)(AttentionParams, DecodeWork)>
cudaError_t launch_decode_grid(size_t smem_bytes, const AttentionParams& p, const DecodeWork& w,
                               cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.num_rows, p.num_kv_heads * ((group + GT - 1) / GT),
                  w.partition_size > 0 ? w.max_partitions : 1);
  // The ring takes over 48 KiB of dynamic shared memory: an opt-in per kernel and device, once
  // (this function exists once per kernel), off a small batch's launch path.
  static std::atomic<uint64_t> opted_in{0};  // a bit per device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) return err;
    opted_in.fetch_or(bit, std::memory_order_relaxed);
  }
  Kernel<<<grid, kDecodeThreads, smem_bytes, stream>>>(p, w);
  err = cudaGetLastError();
  if (err != cudaSuccess || w.partition_size == 0) return err;
  const size_t smem = 2 * sizeof(float) * w.max_partitions;
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(paged_decode_reduce_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
  }
  return launch_overlapping(paged_decode_reduce_kernel<T>, dim3(p.num_rows, p.num_heads), smem, stream,
                            w.overlap_reduce, p, w);
}

}  // namespace
}  // namespace cuda
}  // namespace kvpage
