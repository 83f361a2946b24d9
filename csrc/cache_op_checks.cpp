// The cache ops' argument checks: reshape_and_cache's write (check_cache_write, the slot mapping's
// range), copy_blocks' per-layer caches and swap_blocks' tensor pairs, and their block mappings.
#include "checks.h"

#include <c10/util/Exception.h>
#include <algorithm>
#include <cstdint>
#include <unordered_set>
#include <vector>

namespace kvpage {

namespace {

void check_token_input(const at::Tensor& t, const char* name, const at::Tensor& key_cache,
                       const CacheShape& cache, bool float32_over_16bit) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == cache.num_kv_heads && t.size(2) == cache.head_size,
                    name, " must be [num_tokens, ", cache.num_kv_heads, ", ", cache.head_size,
                    "] to match the cache, got ", t.sizes());
  check_compute_dtype(t, name, key_cache, "the cache", float32_over_16bit);
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

}  // namespace kvpage
