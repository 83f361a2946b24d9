// CPU cache ops: write by slot mapping, copy-on-write block copies, swap. Pure data movement,
// so plain memcpy on torch's threads; nothing ISA-specific.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstring>

#include "../checks.h"
#include "../ops.h"

namespace kvpage {
namespace cpu {
namespace {

// One head's row into an fp8 cache: x * inverse_scale saturated to +-448, then c10's own
// round-to-nearest-even conversion (what torch's .to(float8_e4m3fn) does).
template <typename T>
void quantize_row(const T* in, uint8_t* out, int64_t n, float inverse_scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::clamp(static_cast<float>(in[i]) * inverse_scale, -448.f, 448.f);
    out[i] = c10::detail::fp8e4m3fn_from_fp32_value(x);
  }
}

// Calls write(t, h, cache_row) for each token t with a slot and each KV head h, cache_row the
// element index of its row in the cache: the token loop every write below shares.
template <typename Write>
void for_each_slot_row(int64_t num_tokens, const int64_t* slots, const CacheShape& cache, const Write& write) {
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / cache.block_size, offset = slots[t] % cache.block_size;
      for (int64_t h = 0; h < cache.num_kv_heads; ++h)
        write(t, h, ((block * cache.num_kv_heads + h) * cache.block_size + offset) * cache.head_size);
    }
  });
}

// The write for fp8 caches: per token and head, quantise instead of copying. Only this step's
// tokens pass through here, so a scalar loop costs little next to the layer's matmuls.
void write_fp8(const at::Tensor& src, at::Tensor& dst, const int64_t* slots, const CacheShape& cache,
               double scale) {
  const float inverse_scale = static_cast<float>(1.0 / scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "reshape_and_cache_fp8", [&] {
    const scalar_t* in = src.data_ptr<scalar_t>();
    uint8_t* base = static_cast<uint8_t*>(dst.data_ptr());
    for_each_slot_row(src.size(0), slots, cache, [&](int64_t t, int64_t h, int64_t row) {
      quantize_row(in + t * src.stride(0) + h * src.stride(1), base + row, cache.head_size, inverse_scale);
    });
  });
}

// The write for a 16-bit cache under float32 compute: each element rounded to nearest even (c10's
// conversion, what torch's .to(dtype) does) instead of copied.
template <typename CacheT>
void write_narrowed(const at::Tensor& src, at::Tensor& dst, const int64_t* slots, const CacheShape& cache) {
  const float* in = src.data_ptr<float>();
  CacheT* base = static_cast<CacheT*>(dst.data_ptr());
  for_each_slot_row(src.size(0), slots, cache, [&](int64_t t, int64_t h, int64_t row) {
    const float* x = in + t * src.stride(0) + h * src.stride(1);
    for (int64_t i = 0; i < cache.head_size; ++i) base[row + i] = CacheT(x[i]);
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping, bool check_ranges,
                       double k_scale, double v_scale) {
  const CacheShape cache = check_cache_write(key, value, key_cache, value_cache, slot_mapping, check_ranges,
                                             k_scale, v_scale, /*float32_over_16bit=*/true);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (is_fp8_cache(key_cache.scalar_type())) {
    write_fp8(key, key_cache, slots, cache, k_scale);
    write_fp8(value, value_cache, slots, cache, v_scale);
    return;
  }
  if (key.scalar_type() != key_cache.scalar_type()) {  // float32 into float16 / bfloat16 (checked)
    AT_DISPATCH_REDUCED_FLOATING_TYPES(key_cache.scalar_type(), "reshape_and_cache_narrowed", [&] {
      write_narrowed<scalar_t>(key, key_cache, slots, cache);
      write_narrowed<scalar_t>(value, value_cache, slots, cache);
    });
    return;
  }

  const int64_t es = key.element_size(), row_bytes = cache.head_size * es;
  const char *k_in = static_cast<const char*>(key.data_ptr()), *v_in = static_cast<const char*>(value.data_ptr());
  char *k_out = static_cast<char*>(key_cache.data_ptr()), *v_out = static_cast<char*>(value_cache.data_ptr());
  for_each_slot_row(key.size(0), slots, cache, [&](int64_t t, int64_t h, int64_t row) {
    std::memcpy(k_out + row * es, k_in + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
    std::memcpy(v_out + row * es, v_in + (t * value.stride(0) + h * value.stride(1)) * es, row_bytes);
  });
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const at::Tensor& block_mapping, bool check_ranges) {
  const int64_t num_blocks = check_layer_caches(key_caches, value_caches);
  check_block_mapping(block_mapping, num_blocks, num_blocks, check_ranges && num_blocks > 0, true);
  check_mapping_not_written(block_mapping, key_caches, "key_caches");
  check_mapping_not_written(block_mapping, value_caches, "value_caches");
  if (key_caches.empty()) return;

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
  const auto [src_blocks, dst_blocks] = check_swap_pairs(src, dst);
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK_VALUE(src[i].device().is_cpu() && dst[i].device().is_cpu(),
                      "src and dst must be CPU tensors in a CPU-only swap");
  }
  check_block_mapping(block_mapping, src_blocks, dst_blocks, check_ranges, false);
  check_mapping_not_written(block_mapping, dst, "dst");

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
