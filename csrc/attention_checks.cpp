// The attention ops' argument checks (paged_attention, paged_prefill_attention): query / out, lse,
// the attention options, decode's one token per sequence, and the range checks of block_tables,
// seq_lens and query_start_loc.
#include "checks.h"

#include <c10/util/Exception.h>
#include <cmath>
#include <cstdint>

namespace kvpage {

int64_t check_query(const at::Tensor& query, const at::Tensor& out, const CacheShape& cache,
                    const at::Tensor& key_cache, bool float32_over_16bit) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [num_tokens, num_heads, head_size], got ",
                    query.dim(), " dims");
  check_compute_dtype(query, "query", key_cache, "key_cache", float32_over_16bit);
  TORCH_CHECK_VALUE(query.device() == key_cache.device(),
                    "query must be on the same device as key_cache");
  TORCH_CHECK_VALUE(query.size(2) == cache.head_size, "query head_size ", query.size(2),
                    " differs from key_cache head_size ", cache.head_size);
  TORCH_CHECK_VALUE(query.stride(2) == 1, "query must be contiguous in its last dimension");
  const int64_t num_heads = query.size(1);
  TORCH_CHECK_VALUE(num_heads > 0 && num_heads % cache.num_kv_heads == 0, "query num_heads ",
                    num_heads, " must be a positive multiple of num_kv_heads ", cache.num_kv_heads);
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "out shape ", out.sizes(),
                    " differs from query shape ", query.sizes());
  TORCH_CHECK_TYPE(out.scalar_type() == query.scalar_type(), "out dtype ", out.scalar_type(),
                   " differs from query dtype ", query.scalar_type());
  TORCH_CHECK_VALUE(out.device() == query.device(), "out must be on the same device as query");
  TORCH_CHECK_VALUE(out.stride(2) == 1, "out must be contiguous in its last dimension");
  check_output(out, query, "query");
  return num_heads / cache.num_kv_heads;
}

CacheShape check_attention_inputs(const at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double k_scale, double v_scale, bool float32_over_16bit) {
  const CacheShape cache = check_kv_cache(key_cache, value_cache);
  check_kv_scales(k_scale, v_scale, key_cache);
  check_query(query, out, cache, key_cache, float32_over_16bit);
  check_index_tensor(block_tables, "block_tables", at::kInt, 2, key_cache);
  check_index_tensor(seq_lens, "seq_lens", at::kInt, 1, key_cache);
  TORCH_CHECK_VALUE(block_tables.size(0) == seq_lens.size(0), "block_tables has ",
                    block_tables.size(0), " rows but seq_lens has ", seq_lens.size(0), " entries");
  check_disjoint(out, "out", key_cache, "key_cache");
  check_disjoint(out, "out", value_cache, "value_cache");
  check_disjoint(out, "out", block_tables, "block_tables");
  check_disjoint(out, "out", seq_lens, "seq_lens");
  return cache;
}

float* check_lse(const std::optional<at::Tensor>& lse, const at::Tensor& out, const at::Tensor& query,
                 const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, const at::Tensor* query_start_loc) {
  if (!lse.has_value()) return nullptr;
  const at::Tensor& t = *lse;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "lse must have dtype float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == query.size(0) && t.size(1) == query.size(1),
                    "lse must be [num_tokens, num_heads] = [", query.size(0), ", ", query.size(1), "], got ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.device() == query.device(), "lse must be on the same device as query (", query.device(),
                    "), got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "lse must be contiguous");
  for (const auto& [other, name] : {std::pair<const at::Tensor*, const char*>{&out, "out"}, {&query, "query"},
                                    {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                                    {&block_tables, "block_tables"}, {&seq_lens, "seq_lens"},
                                    {query_start_loc, "query_start_loc"}}) {
    if (other != nullptr) check_disjoint(t, "lse", *other, name);
  }
  return t.data_ptr<float>();
}

AttentionOptions check_attention_options(std::optional<int64_t> sliding_window, std::optional<double> softcap,
                                         const std::optional<at::Tensor>& sinks, const at::Tensor& query,
                                         const at::Tensor& out) {
  AttentionOptions o;
  if (sliding_window.has_value()) {
    TORCH_CHECK_VALUE(*sliding_window > 0 && *sliding_window <= INT32_MAX,
                      "sliding_window must be a positive int32, got ", *sliding_window);
    o.window = *sliding_window;
  }
  if (softcap.has_value()) {
    const float cap = static_cast<float>(*softcap);
    TORCH_CHECK_VALUE(std::isfinite(cap) && cap > 0.f, "softcap must be a positive number finite in float32, got ",
                      *softcap);
    o.softcap = cap;
  }
  if (sinks.has_value()) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "sinks must have dtype float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == query.size(1), "sinks must be [num_heads] = [", query.size(1),
                      "], got ", t.sizes());
    TORCH_CHECK_VALUE(t.device() == query.device(), "sinks must be on the same device as query (", query.device(),
                      "), got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), "sinks must be contiguous");
    check_disjoint(out, "out", t, "sinks");
    o.sinks = t.data_ptr<float>();
  }
  return o;
}

void check_decode(const at::Tensor& query, const at::Tensor& seq_lens, int64_t partition_size,
                  const CacheShape& cache) {
  TORCH_CHECK_VALUE(query.size(0) == seq_lens.size(0), "query has ", query.size(0),
                    " tokens but seq_lens has ", seq_lens.size(0),
                    " sequences (decode takes one query token per sequence)");
  TORCH_CHECK_VALUE(partition_size >= 0 && partition_size % cache.block_size == 0,
                    "partition_size must be a non-negative multiple of block_size ", cache.block_size,
                    ", got ", partition_size);
}

namespace {

// seq_lens in [min_len, what one block_tables row can hold] (the kernels read that much of a row).
void check_seq_lens(const int32_t* lens, int64_t num_seqs, const at::Tensor& block_tables, const CacheShape& cache,
                    int64_t min_len) {
  const int64_t capacity = block_tables.size(1) * cache.block_size;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK_VALUE(lens[s] >= min_len && lens[s] <= capacity, "seq_lens[", s, "] = ", lens[s],
                      " must be in [", min_len, ", ", capacity,
                      "] (a block_tables row holds block_tables.size(1) * block_size tokens)");
  }
}

// query_start_loc non-decreasing from 0 to num_tokens, each q_len <= seq_len.
void check_query_start_loc(const int32_t* q, const int32_t* lens, int64_t num_seqs, int64_t num_tokens) {
  TORCH_CHECK_VALUE(q[0] == 0, "query_start_loc[0] must be 0, got ", q[0]);
  TORCH_CHECK_VALUE(q[num_seqs] == num_tokens, "query_start_loc[-1] = ", q[num_seqs],
                    " must equal the number of query tokens ", num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = int64_t(q[s + 1]) - q[s];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must be non-decreasing (at ", s, ")");
    TORCH_CHECK_VALUE(q_len <= lens[s], "seq_lens[", s, "] = ", lens[s], " is shorter than its query length ",
                      q_len);
  }
}

}  // namespace

void check_attention_ranges(const at::Tensor& block_tables, const at::Tensor& seq_lens, const CacheShape& cache,
                            int64_t min_len, int64_t window, const at::Tensor* query_start_loc,
                            int64_t num_tokens) {
  count_range_check();
  const auto tables = block_tables.cpu();  // on a GPU: the host copies (syncs) the switch exists for
  const auto lens = seq_lens.cpu();
  const auto loc = query_start_loc != nullptr ? query_start_loc->cpu() : at::Tensor();
  const int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* l = lens.data_ptr<int32_t>();
  const int32_t* q = loc.defined() ? loc.data_ptr<int32_t>() : nullptr;
  const int64_t num_seqs = lens.numel();
  if (q != nullptr) check_query_start_loc(q, l, num_seqs, num_tokens);
  check_seq_lens(l, num_seqs, block_tables, cache, min_len);
  const int64_t max_blocks = tables.size(1);
  for (int64_t s = 0; s < tables.size(0); ++s) {
    const int64_t used = (int64_t(l[s]) + cache.block_size - 1) / cache.block_size;
    const int64_t q_len = q != nullptr ? int64_t(q[s + 1]) - q[s] : 1;
    for (int64_t b = first_window_block(l[s] - q_len, window, cache.block_size); b < used; ++b) {
      const int32_t id = t[s * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < cache.num_blocks, "block_tables[", s, ", ", b, "] = ", id,
                        " is outside the cache's ", cache.num_blocks, " blocks");
    }
  }
}

void check_query_start_loc_tensor(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  const at::Tensor& out, const at::Tensor& key_cache) {
  check_index_tensor(query_start_loc, "query_start_loc", at::kInt, 1, key_cache);
  TORCH_CHECK_VALUE(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc must have num_seqs + 1 = ",
                    seq_lens.size(0) + 1, " entries, got ", query_start_loc.size(0));
  check_disjoint(out, "out", query_start_loc, "query_start_loc");
}

}  // namespace kvpage
