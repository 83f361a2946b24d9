// CPU cache ops: write by slot mapping, copy-on-write block copies, swap. Pure data movement,
// so plain memcpy on torch's threads; nothing ISA-specific.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "../checks.h"
#include "../ops.h"

namespace kvpage {
namespace cpu {
namespace {

void check_token_input(const at::Tensor& t, const char* name, const at::Tensor& key_cache,
                       const CacheShape& cache) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == cache.num_kv_heads && t.size(2) == cache.head_size,
                    name, " must be [num_tokens, ", cache.num_kv_heads, ", ", cache.head_size,
                    "] to match the cache, got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == key_cache.scalar_type(), name, " dtype ", t.scalar_type(),
                   " differs from the cache dtype ", key_cache.scalar_type());
  TORCH_CHECK_VALUE(t.device() == key_cache.device(), name, " must be on the cache's device");
  TORCH_CHECK_VALUE(t.stride(2) == 1, name, " must be contiguous in its last dimension");
}

// Bytes of one block of a cache-like tensor [num_blocks, ...].
int64_t block_bytes(const at::Tensor& t) {
  return t.size(0) == 0 ? 0 : t.numel() / t.size(0) * t.element_size();
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping, bool check_ranges) {
  const CacheShape cache = check_kv_cache(key_cache, value_cache);
  check_token_input(key, "key", key_cache, cache);
  check_token_input(value, "value", key_cache, cache);
  TORCH_CHECK_VALUE(value.size(0) == key.size(0), "value has ", value.size(0), " tokens, key has ",
                    key.size(0));
  check_index_tensor(slot_mapping, "slot_mapping", at::kLong, 1, key_cache);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
                    " entries for ", key.size(0), " tokens");
  if (check_ranges) check_slot_mapping_range(slot_mapping, cache);

  const int64_t es = key.element_size(), row_bytes = cache.head_size * es;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto copy_token = [&](const at::Tensor& src, at::Tensor& dst, int64_t t, int64_t slot) {
    const char* in = static_cast<const char*>(src.data_ptr()) + t * src.stride(0) * es;
    char* base = static_cast<char*>(dst.data_ptr());
    const int64_t block = slot / cache.block_size, offset = slot % cache.block_size;
    for (int64_t h = 0; h < cache.num_kv_heads; ++h) {
      const int64_t tile = (block * cache.num_kv_heads + h) * cache.block_size + offset;
      std::memcpy(base + tile * row_bytes, in + h * src.stride(1) * es, row_bytes);
    }
  };
  at::parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      copy_token(key, key_cache, t, slots[t]);
      copy_token(value, value_cache, t, slots[t]);
    }
  });
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const at::Tensor& block_mapping, bool check_ranges) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
                    " layers but value_caches has ", value_caches.size());
  if (key_caches.empty()) return check_block_mapping(block_mapping, 0, 0, false, false);
  for (size_t i = 0; i < key_caches.size(); ++i) {
    check_kv_cache(key_caches[i], value_caches[i]);
    TORCH_CHECK_VALUE(key_caches[i].sizes() == key_caches[0].sizes() &&
                          key_caches[i].scalar_type() == key_caches[0].scalar_type() &&
                          key_caches[i].device() == key_caches[0].device(),
                      "key_caches[", i, "] differs from key_caches[0] in shape, dtype or device");
  }
  const int64_t num_blocks = key_caches[0].size(0);
  check_block_mapping(block_mapping, num_blocks, num_blocks, check_ranges, true);

  const auto mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t n = mapping.size(0), layers = key_caches.size(), bytes = block_bytes(key_caches[0]);
  // One item per (layer, K or V, pair), all layers in one parallel loop.
  at::parallel_for(0, layers * 2 * n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i % n, kv = (i / n) % 2, layer = i / (2 * n);
      char* base = static_cast<char*>((kv ? value_caches : key_caches)[layer].data_ptr());
      std::memcpy(base + pairs[2 * pair + 1] * bytes, base + pairs[2 * pair] * bytes, bytes);
    }
  });
}

void swap_blocks(at::TensorList src, at::TensorList dst, const at::Tensor& block_mapping,
                 bool check_ranges) {
  TORCH_CHECK_VALUE(src.size() == dst.size(), "src has ", src.size(), " tensors but dst has ",
                    dst.size());
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
    TORCH_CHECK_VALUE(src[i].device().is_cpu() && dst[i].device().is_cpu(),
                      "src and dst must be CPU tensors in a CPU-only swap");
    src_blocks = std::min(src_blocks, src[i].size(0));
    dst_blocks = std::min(dst_blocks, dst[i].size(0));
  }
  if (src.empty()) src_blocks = dst_blocks = 0;
  check_block_mapping(block_mapping, src_blocks, dst_blocks, check_ranges, false);

  const auto mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t n = mapping.size(0), tensors = src.size();
  at::parallel_for(0, tensors * n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i % n, t = i / n, bytes = block_bytes(src[t]);
      std::memcpy(static_cast<char*>(dst[t].data_ptr()) + pairs[2 * pair + 1] * bytes,
                  static_cast<const char*>(src[t].data_ptr()) + pairs[2 * pair] * bytes, bytes);
    }
  });
}

}  // namespace cpu
}  // namespace kvpage
