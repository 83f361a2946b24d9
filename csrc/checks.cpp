#include "checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <unordered_set>

namespace kvpage {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// The bytes [lo, hi) a tensor's elements span; an empty tensor spans nothing.
struct ByteSpan {
  uintptr_t lo = 0, hi = 0;
};

ByteSpan byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {};
  int64_t low = 0, high = 0;  // element offsets of the extreme elements from the first one
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? low : high) += reach;
  }
  const uintptr_t first = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t size = t.element_size();
  return {first + low * size, first + (high + 1) * size};
}

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

// What a cache accepts as query / key / value: a compute dtype, the cache's own unless the cache is
// fp8 (quantised on write, dequantised on read; fp8 itself never computes) or, where the backend
// takes it, a 16-bit cache under float32 compute (vLLM's kv_cache_dtype="bfloat16" / "float16" for a
// float32 model: rounded on write, widened on read; the CPU backend does, the CUDA one not yet).
bool matches_cache(at::ScalarType t, at::ScalarType cache_dtype, bool float32_over_16bit) {
  const bool narrowed = float32_over_16bit && t == at::kFloat &&
                        (cache_dtype == at::kHalf || cache_dtype == at::kBFloat16);
  return is_supported_float(t) && (t == cache_dtype || is_fp8_cache(cache_dtype) || narrowed);
}

std::atomic<int64_t> range_check_runs{0};

void count_range_check() { range_check_runs.fetch_add(1, std::memory_order_relaxed); }

constexpr const char* kCacheDtypeRule =
    " (it must be the same, float32/float16/bfloat16 with an fp8 cache, or float32 with a float16/bfloat16"
    " cache on the CPU backend)";

}  // namespace

bool memory_overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device()) return false;
  const ByteSpan x = byte_span(a), y = byte_span(b);
  return x.lo < x.hi && y.lo < y.hi && x.lo < y.hi && y.lo < x.hi;
}

void check_disjoint(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_VALUE(!memory_overlaps(a, b), a_name, " and ", b_name, " share memory; they must not overlap");
}

void check_output(const at::Tensor& out, const at::Tensor& input, const char* input_name) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(out) != at::MemOverlap::Yes,
                    "out has elements that share memory (an expanded or stride-0 tensor); it must not");
  TORCH_CHECK_VALUE(same_view(out, input) || !memory_overlaps(out, input), "out partly overlaps ", input_name,
                    "; pass out=", input_name, " itself or a tensor of its own");
}

CacheShape check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4,
                    "key_cache must be [num_blocks, num_kv_heads, block_size, head_size], got ",
                    key_cache.dim(), " dims");
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(),
                    "value_cache shape ", value_cache.sizes(), " differs from key_cache shape ",
                    key_cache.sizes());
  TORCH_CHECK_TYPE(is_supported_float(key_cache.scalar_type()) || is_fp8_cache(key_cache.scalar_type()),
                   "key_cache dtype must be float32, float16, bfloat16 or float8_e4m3fn, got ",
                   key_cache.scalar_type());
  TORCH_CHECK_TYPE(value_cache.scalar_type() == key_cache.scalar_type(),
                   "value_cache dtype ", value_cache.scalar_type(), " differs from key_cache dtype ",
                   key_cache.scalar_type());
  TORCH_CHECK_VALUE(value_cache.device() == key_cache.device(),
                    "value_cache and key_cache must be on the same device");
  TORCH_CHECK_VALUE(key_cache.is_contiguous(), "key_cache must be contiguous (use allocate_kv_cache)");
  TORCH_CHECK_VALUE(value_cache.is_contiguous(),
                    "value_cache must be contiguous (use allocate_kv_cache)");
  CacheShape s{key_cache.size(0), key_cache.size(1), key_cache.size(2), key_cache.size(3)};
  TORCH_CHECK_VALUE(s.num_blocks > 0 && s.num_kv_heads > 0, "key_cache has no blocks or heads");
  TORCH_CHECK_VALUE(is_power_of_two(s.block_size) && s.block_size <= 256,
                    "key_cache block_size must be a power of two up to 256, got ", s.block_size);
  TORCH_CHECK_VALUE(s.head_size > 0 && s.head_size % 16 == 0 && s.head_size <= 256,
                    "key_cache head_size must be a multiple of 16 up to 256, got ", s.head_size);
  return s;
}

int64_t check_query(const at::Tensor& query, const at::Tensor& out, const CacheShape& cache,
                    const at::Tensor& key_cache, bool float32_over_16bit) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [num_tokens, num_heads, head_size], got ",
                    query.dim(), " dims");
  TORCH_CHECK_TYPE(matches_cache(query.scalar_type(), key_cache.scalar_type(), float32_over_16bit),
                   "query dtype ", query.scalar_type(),
                   " does not match key_cache dtype ", key_cache.scalar_type(), kCacheDtypeRule);
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

void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                        const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on device ", like.device(),
                    ", got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

void check_kv_scales(double k_scale, double v_scale, const at::Tensor& key_cache) {
  for (const auto& [value, name] : {std::pair<double, const char*>{k_scale, "k_scale"}, {v_scale, "v_scale"}}) {
    // The kernels hold the scale and its reciprocal in float32: both must stay finite and nonzero.
    TORCH_CHECK_VALUE(value >= FLT_MIN && value <= FLT_MAX, name,
                      " must be a positive number in float32's normal range [", FLT_MIN, ", ", FLT_MAX,
                      "], got ", value);
    TORCH_CHECK_VALUE(value == 1.0 || is_fp8_cache(key_cache.scalar_type()), name, " = ", value,
                      " applies to fp8 caches only; a ", key_cache.scalar_type(), " cache takes 1.0");
  }
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

void check_token_input(const at::Tensor& t, const char* name, const at::Tensor& key_cache,
                       const CacheShape& cache, bool float32_over_16bit) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == cache.num_kv_heads && t.size(2) == cache.head_size,
                    name, " must be [num_tokens, ", cache.num_kv_heads, ", ", cache.head_size,
                    "] to match the cache, got ", t.sizes());
  TORCH_CHECK_TYPE(matches_cache(t.scalar_type(), key_cache.scalar_type(), float32_over_16bit), name, " dtype ",
                   t.scalar_type(),
                   " does not match the cache dtype ", key_cache.scalar_type(), kCacheDtypeRule);
  TORCH_CHECK_VALUE(t.device() == key_cache.device(), name, " must be on the cache's device");
  TORCH_CHECK_VALUE(t.stride(2) == 1, name, " must be contiguous in its last dimension");
}

}  // namespace

CacheShape check_cache_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                             bool check_ranges, double k_scale, double v_scale, bool float32_over_16bit) {
  const CacheShape cache = check_kv_cache(key_cache, value_cache);
  check_kv_scales(k_scale, v_scale, key_cache);
  check_token_input(key, "key", key_cache, cache, float32_over_16bit);
  check_token_input(value, "value", key_cache, cache, float32_over_16bit);
  // An fp8 cache quantises each of them from its own dtype; any other write takes one dtype for both.
  TORCH_CHECK_TYPE(is_fp8_cache(key_cache.scalar_type()) || value.scalar_type() == key.scalar_type(),
                   "value dtype ", value.scalar_type(), " differs from key dtype ", key.scalar_type());
  TORCH_CHECK_VALUE(value.size(0) == key.size(0), "value has ", value.size(0), " tokens, key has ",
                    key.size(0));
  check_index_tensor(slot_mapping, "slot_mapping", at::kLong, 1, key_cache);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
                    " entries for ", key.size(0), " tokens");
  check_disjoint(key_cache, "key_cache", value_cache, "value_cache");
  for (const auto& [input, name] : {std::pair<const at::Tensor&, const char*>{key, "key"}, {value, "value"},
                                    {slot_mapping, "slot_mapping"}}) {
    check_disjoint(input, name, key_cache, "key_cache");
    check_disjoint(input, name, value_cache, "value_cache");
  }
  if (check_ranges) check_slot_mapping_range(slot_mapping, cache);
  return cache;
}

int64_t check_layer_caches(at::TensorList key_caches, at::TensorList value_caches) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
                    " layers but value_caches has ", value_caches.size());
  for (size_t i = 0; i < key_caches.size(); ++i) {
    check_kv_cache(key_caches[i], value_caches[i]);
    TORCH_CHECK_VALUE(key_caches[i].sizes() == key_caches[0].sizes() &&
                          key_caches[i].scalar_type() == key_caches[0].scalar_type() &&
                          key_caches[i].device() == key_caches[0].device(),
                      "key_caches[", i, "] differs from key_caches[0] in shape, dtype or device");
    TORCH_CHECK_VALUE(!memory_overlaps(key_caches[i], value_caches[i]), "key_caches[", i, "] and value_caches[",
                      i, "] share memory; they must not overlap");
  }
  return key_caches.empty() ? 0 : key_caches[0].size(0);
}

std::pair<int64_t, int64_t> check_swap_pairs(at::TensorList src, at::TensorList dst) {
  TORCH_CHECK_VALUE(src.size() == dst.size(), "src has ", src.size(), " tensors but dst has ",
                    dst.size());
  if (src.empty()) return {0, 0};
  int64_t src_blocks = INT64_MAX, dst_blocks = INT64_MAX;
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK_VALUE(src[i].dim() >= 2 && dst[i].dim() == src[i].dim() &&
                          src[i].sizes().slice(1) == dst[i].sizes().slice(1),
                      "src[", i, "] ", src[i].sizes(), " and dst[", i, "] ", dst[i].sizes(),
                      " must be [num_blocks, ...] with the same block shape");
    TORCH_CHECK_TYPE(src[i].scalar_type() == dst[i].scalar_type(), "src[", i, "] dtype ",
                     src[i].scalar_type(), " differs from dst[", i, "] dtype ", dst[i].scalar_type());
    TORCH_CHECK_VALUE(src[i].is_contiguous() && dst[i].is_contiguous(), "src[", i, "] and dst[", i,
                      "] must be contiguous");
    src_blocks = std::min(src_blocks, src[i].size(0));
    dst_blocks = std::min(dst_blocks, dst[i].size(0));
  }
  for (size_t i = 0; i < src.size(); ++i)  // one pass reads src while writing dst
    for (size_t j = 0; j < dst.size(); ++j)
      TORCH_CHECK_VALUE(!memory_overlaps(src[i], dst[j]), "src[", i, "] and dst[", j,
                        "] share memory; they must not overlap");
  for (size_t i = 0; i < dst.size(); ++i)  // the copies into them run in parallel
    for (size_t j = i + 1; j < dst.size(); ++j)
      TORCH_CHECK_VALUE(!memory_overlaps(dst[i], dst[j]), "dst[", i, "] and dst[", j,
                        "] share memory; each must be a tensor of its own");
  return {src_blocks, dst_blocks};
}

int64_t range_checks_run() { return range_check_runs.load(std::memory_order_relaxed); }

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

void check_slot_mapping_range(const at::Tensor& slot_mapping, const CacheShape& cache) {
  count_range_check();
  const auto slots = slot_mapping.cpu();
  const int64_t* p = slots.data_ptr<int64_t>();
  const int64_t num_slots = cache.num_blocks * cache.block_size;
  std::vector<std::pair<int64_t, int64_t>> written;  // (slot, token)
  written.reserve(size_t(slots.numel()));
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] >= -1 && p[i] < num_slots, "slot_mapping[", i, "] = ", p[i],
                      " is outside the cache's ", num_slots, " slots (-1 skips a token)");
    if (p[i] >= 0) written.emplace_back(p[i], i);
  }
  // Tokens are written in parallel: two into one slot would leave whichever thread came last.
  std::sort(written.begin(), written.end());
  const auto twice = std::adjacent_find(written.begin(), written.end(),
                                        [](const auto& a, const auto& b) { return a.first == b.first; });
  TORCH_CHECK_VALUE(twice == written.end(), "slot_mapping[", twice->second, "] and slot_mapping[",
                    (twice + 1)->second, "] both write slot ", twice->first,
                    "; each slot takes at most one token per call");
}

void check_block_mapping(const at::Tensor& block_mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks, bool check_ranges, bool forbid_src_dst_overlap) {
  TORCH_CHECK_TYPE(block_mapping.scalar_type() == at::kLong,
                   "block_mapping must have dtype int64, got ", block_mapping.scalar_type());
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
                    "block_mapping must be [n, 2] of (src, dst), got shape ", block_mapping.sizes());
  TORCH_CHECK_VALUE(block_mapping.device().is_cpu(), "block_mapping must be a CPU tensor");
  if (!check_ranges) return;
  count_range_check();
  const auto m = block_mapping.contiguous();
  const int64_t* p = m.data_ptr<int64_t>();
  std::unordered_set<int64_t> dsts;
  for (int64_t i = 0; i < m.size(0); ++i) {
    const int64_t src = p[2 * i], dst = p[2 * i + 1];
    TORCH_CHECK_VALUE(src >= 0 && src < num_src_blocks, "block_mapping[", i, "] source block ", src,
                      " is outside [0, ", num_src_blocks, ")");
    TORCH_CHECK_VALUE(dst >= 0 && dst < num_dst_blocks, "block_mapping[", i,
                      "] destination block ", dst, " is outside [0, ", num_dst_blocks, ")");
    // Copies run in parallel: two writers to one block would race.
    TORCH_CHECK_VALUE(dsts.insert(dst).second, "block_mapping writes destination block ", dst,
                      " twice");
  }
  if (!forbid_src_dst_overlap) return;
  for (int64_t i = 0; i < m.size(0); ++i) {
    TORCH_CHECK_VALUE(!dsts.count(p[2 * i]), "block_mapping reads block ", p[2 * i],
                      " that it also overwrites (order-dependent result)");
  }
}

void check_mapping_not_written(const at::Tensor& block_mapping, at::TensorList written, const char* name) {
  for (size_t i = 0; i < written.size(); ++i)
    TORCH_CHECK_VALUE(!memory_overlaps(block_mapping, written[i]), "block_mapping and ", name, "[", i,
                      "] share memory; the mapping must not lie in a tensor it writes");
}

void check_query_start_loc_tensor(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  const at::Tensor& out, const at::Tensor& key_cache) {
  check_index_tensor(query_start_loc, "query_start_loc", at::kInt, 1, key_cache);
  TORCH_CHECK_VALUE(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc must have num_seqs + 1 = ",
                    seq_lens.size(0) + 1, " entries, got ", query_start_loc.size(0));
  check_disjoint(out, "out", query_start_loc, "query_start_loc");
}

}  // namespace kvpage
