// Argument validation shared by every backend. Failures raise Python ValueError / TypeError
// naming the argument (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE), never undefined behaviour.
// Defined in checks.cpp (what every op's checks build on), attention_checks.cpp (the attention ops')
// and cache_op_checks.cpp (the cache ops': write, copy, swap).
#pragma once

#include <ATen/core/Tensor.h>
#include <optional>
#include <utility>
#include <vector>

#include "attention_window.h"

namespace kvpage {

// float8_e4m3fn caches store K/V quantised with per-tensor scales (ops.h).
inline bool is_fp8_cache(at::ScalarType t) { return t == at::kFloat8_e4m3fn; }

// k_scale / v_scale: positive in float32's normal range (the kernels hold them and their reciprocals
// in float32); anything but 1.0 only for an fp8 cache.
void check_kv_scales(double k_scale, double v_scale, const at::Tensor& key_cache);

// Whether two tensors' element byte ranges intersect (same device); out must not partly overlap its
// input (out = input itself is fine), nor hold elements that share memory.
bool memory_overlaps(const at::Tensor& a, const at::Tensor& b);
void check_disjoint(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name);
void check_output(const at::Tensor& out, const at::Tensor& input, const char* input_name);

struct CacheShape {
  int64_t num_blocks, num_kv_heads, block_size, head_size;
};

// Validates one (key_cache, value_cache) pair and returns its shape.
CacheShape check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache);

// A compute tensor's dtype (query, key or value, called `name`) against the cache's: the same, any of
// float32 / float16 / bfloat16 over an fp8 cache, or (float32_over_16bit) float32 over a float16 /
// bfloat16 cache. cache_name words the cache in the error ("key_cache", "the cache").
void check_compute_dtype(const at::Tensor& t, const char* name, const at::Tensor& key_cache, const char* cache_name,
                         bool float32_over_16bit);

// query/out [num_tokens, num_heads, head_size] against a cache; returns num_heads / num_kv_heads.
// float32_over_16bit: the backend computes float32 over a float16 / bfloat16 cache (the CPU one does;
// the CUDA kernels have no such pairing).
int64_t check_query(const at::Tensor& query, const at::Tensor& out, const CacheShape& cache,
                    const at::Tensor& key_cache, bool float32_over_16bit = false);

void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                        const at::Tensor& like);

// Shapes, dtypes and devices of an attention call (no index data read); returns the cache shape.
CacheShape check_attention_inputs(const at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double k_scale, double v_scale, bool float32_over_16bit = false);

// An attention op's optional lse output: float32 [num_tokens, num_heads] (query's first two sizes),
// contiguous, on query's device, sharing no memory with the op's other tensors (query_start_loc:
// prefill's, or null). Returns its data, or null when lse is absent.
float* check_lse(const std::optional<at::Tensor>& lse, const at::Tensor& out, const at::Tensor& query,
                 const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, const at::Tensor* query_start_loc = nullptr);

// The attention options (ops.h) as the kernels take them: window 0 and softcap 0 mean none, sinks
// the float32 [num_heads] data (on query's device) or null.
struct AttentionOptions {
  int64_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;
};

// sliding_window positive (and within int32, the kernels' position type), softcap positive and finite
// in float32, sinks float32 [num_heads] contiguous on query's device, sharing no memory with out.
AttentionOptions check_attention_options(std::optional<int64_t> sliding_window, std::optional<double> softcap,
                                         const std::optional<at::Tensor>& sinks, const at::Tensor& query,
                                         const at::Tensor& out);

// Decode: one query token per sequence; partition_size 0 (auto) or a multiple of block_size.
void check_decode(const at::Tensor& query, const at::Tensor& seq_lens, int64_t partition_size,
                  const CacheShape& cache);

// reshape_and_cache's arguments; when check_ranges, the slot range check and that no slot is written
// twice (both read slot_mapping: a range check).
CacheShape check_cache_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                             bool check_ranges, double k_scale, double v_scale, bool float32_over_16bit = false);

// copy_blocks' per-layer caches: all alike; returns num_blocks (0 for no layers).
int64_t check_layer_caches(at::TensorList key_caches, at::TensorList value_caches);

// swap_blocks' tensor pairs: same block shape and dtype, contiguous. Returns the fewest blocks
// among src and among dst (what every mapping entry must stay below). Devices are the backend's.
std::pair<int64_t, int64_t> check_swap_pairs(at::TensorList src, at::TensorList dst);

// Bytes of one block of a cache-like tensor [num_blocks, ...].
inline int64_t block_bytes(const at::Tensor& t) {
  return t.size(0) == 0 ? 0 : t.numel() / t.size(0) * t.element_size();
}

// Range checks: the checks that read index data (block ids, slot mapping, seq_lens, query_start_loc).
// On a GPU each copies tensors to the host, a device sync, so the ops run them only when asked
// (check_ranges: Python's debug switch, KVPAGE_RANGE_CHECKS=1; the engine's own indices are trusted).
// Everything else checked here reads metadata only (shape, dtype, device, strides): always on.
// Each run of one counts in range_checks_run(), so tests can see that a switched-off op ran none.
int64_t range_checks_run();
void count_range_check();  // each range check calls it once per run

// An attention op's range checks: query_start_loc (prefill's, null for decode's one query per
// sequence) non-decreasing from 0 to num_tokens with each q_len <= seq_len, seq_lens in [min_len,
// what one block_tables row holds], and the block ids the kernels read in [0, num_blocks): a
// sequence's blocks from the first its earliest query's window reaches up to seq_len.
void check_attention_ranges(const at::Tensor& block_tables, const at::Tensor& seq_lens, const CacheShape& cache,
                            int64_t min_len, int64_t window, const at::Tensor* query_start_loc,
                            int64_t num_tokens);
void check_slot_mapping_range(const at::Tensor& slot_mapping, const CacheShape& cache);
void check_block_mapping(const at::Tensor& block_mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks, bool check_ranges, bool forbid_src_dst_overlap);
// block_mapping is read while the copies write `written` (named `name`[i]): it must not lie in them.
void check_mapping_not_written(const at::Tensor& block_mapping, at::TensorList written, const char* name);

// query_start_loc's dtype, rank, device and length (num_seqs + 1), and that out (written while it is
// read) does not hold it.
void check_query_start_loc_tensor(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  const at::Tensor& out, const at::Tensor& key_cache);

}  // namespace kvpage
