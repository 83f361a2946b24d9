// The interface between the CUDA op glue (ops_*.cpp: ATen, guards, checks) and the kernels
// (*.cu). Kernel files see only this header and CUDA's own: raw pointers, plain structs, so
// they compile standalone with nvcc (CI compile-checks them without torch) and fast.
//
// KV-cache layout (see ops.h): [num_blocks, num_kv_heads, block_size, head_size], contiguous,
// 16-byte aligned. Every kernel treats its index inputs as untrusted: a block id or slot outside
// the cache, or a length beyond a block-table row, is masked or skipped, never dereferenced,
// so switching the host-side range checks off cannot cause an out-of-bounds access.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace kvpage {
namespace cuda {

// kFp8E4M3 is a cache dtype only (float8_e4m3fn codes, value = code * scale); queries, outputs
// and the keys / values written into a cache are one of the other three.
enum class DType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2, kFp8E4M3 = 3 };

__host__ __device__ constexpr int dtype_size(DType t) {
  return t == DType::kFloat ? 4 : t == DType::kFp8E4M3 ? 1 : 2;
}

// Query rows attend over one sequence's paged K/V. Decode: row r is sequence r and sees all
// seq_lens[r] tokens. Prefill (query_start_loc set): row r is a query token; it belongs to the
// sequence s with query_start_loc[s] <= r < query_start_loc[s + 1] and sees the cache
// positions <= seq_lens[s] - q_len[s] + (r - query_start_loc[s]).
struct AttentionParams {
  DType dtype;        // query and out
  DType cache_dtype;  // key_cache and value_cache: dtype, or kFp8E4M3 with any query dtype
  float k_scale, v_scale;  // an fp8 code in key / value cache is worth code * scale; 1 otherwise
  void* out;  // [num_rows, num_heads, head_size], last dim contiguous
  int64_t out_row_stride, out_head_stride;
  const void* query;  // same shape as out
  int64_t q_row_stride, q_head_stride;
  const void* key_cache;
  const void* value_cache;
  int num_heads, num_kv_heads, block_size, head_size;
  int num_blocks;                 // guards block ids read from the table
  const int32_t* block_tables;    // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq;
  const int32_t* seq_lens;        // [num_seqs]
  const int32_t* query_start_loc; // [num_seqs + 1]; nullptr for decode
  int num_seqs;
  int num_rows;                   // decode: num_seqs; prefill: total query tokens
  float scale;
  // [num_rows, num_heads], contiguous, or nullptr: each row's natural log of sum_j exp(scale q.k_j)
  // (-inf where it sees no key), for merging partial results over disjoint keys; sinks included.
  float* lse;
  // The attention options (ops.h). window: a row at position p sees keys in (p - window, p], 0:
  // none; a row starts reading at its first visible key, so earlier table entries are never read.
  // softcap: in the log2 domain the logits live in, c * log2(e) (0: none). sinks: [num_heads]
  // natural-log logits, or nullptr.
  int window;
  float softcap;
  const float* sinks;
};

// Decode work split. partition_size == 0: one CTA per (row, kv head group) walks the whole
// context and writes out directly. Otherwise CTAs also split the context, from the row's first
// visible key, into max_partitions fixed partitions, write unnormalised partials to tmp_* and a
// reduce kernel merges them (and adds the sinks).
struct DecodeWork {
  int partition_size;
  int max_partitions;
  float* tmp_out;  // [num_rows, num_heads, max_partitions, head_size]
  float* tmp_max;  // [num_rows, num_heads, max_partitions], log2 domain
  float* tmp_sum;  // [num_rows, num_heads, max_partitions]
  bool overlap_reduce;  // launch the reduce as a programmatic dependent (the device is sm_90+)
};

// Whether launch_paged_decode runs these on tensor cores: fp16 / bf16 queries over their own
// dtype's cache, GQA groups (2 or more query heads per KV head), head sizes up to 128. The rest
// (fp32, fp8 caches, MHA, head sizes 192 / 256) take the SIMT kernel.
bool decode_uses_tensor_cores(const AttentionParams& p);

// The decode kernel serving p, as the split planner sees it: its CTAs per query row and partition
// (one per KV head and tile of its GQA group's query heads), and the CTAs one SM runs at once
// (its register budget's, or fewer where its shared memory, the K/V ring, fills the SM's
// shared_memory_per_sm bytes).
struct DecodeOccupancy {
  int ctas_per_row;
  int ctas_per_sm;
};
DecodeOccupancy decode_occupancy(const AttentionParams& p, int shared_memory_per_sm);

// Decode, and the prefill the tensor-core kernel does not serve (fp32 queries, over fp32 or fp8
// caches: prefill rows through the same SIMT kernel, single pass).
cudaError_t launch_paged_decode(const AttentionParams& p, const DecodeWork& work, cudaStream_t stream);

// Prefill's device scratch and the GPU's SM count: at head size 64, a grid short of a CTA per SM
// gets CTAs of 8 warps (16 query rows each) instead of 4 (32 rows each), so each busy SM has
// twice the warps.
struct PrefillWork {
  int32_t* tile_offsets;  // num_seqs + 1 ints
  int num_sms;
};

// Tensor-core prefill for fp16/bf16 queries over their own dtype's cache or an fp8 one.
// query must be 16-byte aligned with row/head strides that are multiples of 8 elements.
cudaError_t launch_paged_prefill(const AttentionParams& p, const PrefillWork& work, cudaStream_t stream);
// Whether launch_paged_prefill serves these dtypes (the rest take launch_paged_decode).
bool prefill_uses_tensor_cores(const AttentionParams& p);

// One of the two tensors reshape_and_cache writes (key into key_cache, value into value_cache).
struct CacheWriteSource {
  const void* data;  // [num_tokens, num_kv_heads, head_size], strides in elements
  int64_t token_stride, head_stride;
  DType dtype;       // the cache's, or any compute dtype for an fp8 cache
  bool vectorized;   // base and strides allow 16-byte loads
  float inverse_scale;  // fp8 caches store x * inverse_scale (float(1.0 / scale)), saturated
  void* cache;
};

struct CacheWriteParams {
  CacheWriteSource key, value;
  DType cache_dtype;
  const int64_t* slot_mapping;  // [num_tokens], -1 skips
  int64_t num_tokens, num_slots;
  int num_kv_heads, block_size, head_size;
};
cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream);

// One tensor whose blocks move: copy_blocks passes each layer's K and V cache with src == dst;
// swap_blocks passes (GPU, mapped pinned host) pairs. Fields are int64 so the host can fill the
// whole table, plus the (src, dst) pairs, into one pinned buffer and upload it in one copy.
struct BlockCopyTensor {
  int64_t src;          // device-accessible address of block 0
  int64_t dst;
  int64_t block_bytes;
  int64_t src_blocks;   // bounds: pairs outside them are skipped
  int64_t dst_blocks;
};
static_assert(sizeof(BlockCopyTensor) == 5 * sizeof(int64_t), "packed as int64 words");

// Copies block pairs[i].src -> pairs[i].dst of every tensor: one launch for all tensors and pairs.
// tensors and pairs are device (or mapped) memory.
cudaError_t launch_block_copy(const BlockCopyTensor* tensors, int num_tensors, const int64_t* pairs,
                              int64_t num_pairs, int64_t max_block_bytes, bool all_aligned16,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace kvpage
