// What every op's argument checks build on: tensor overlap, the (key_cache, value_cache) pair, index
// tensors, fp8 scales, the compute dtype a cache accepts, and the range-check counter. The attention
// ops' checks are in attention_checks.cpp, the cache ops' in cache_op_checks.cpp.
#include "checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <atomic>
#include <cfloat>
#include <cstdint>

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

void check_compute_dtype(const at::Tensor& t, const char* name, const at::Tensor& key_cache, const char* cache_name,
                         bool float32_over_16bit) {
  TORCH_CHECK_TYPE(matches_cache(t.scalar_type(), key_cache.scalar_type(), float32_over_16bit), name, " dtype ",
                   t.scalar_type(), " does not match ", cache_name, " dtype ", key_cache.scalar_type(),
                   kCacheDtypeRule);
}

void count_range_check() { range_check_runs.fetch_add(1, std::memory_order_relaxed); }

int64_t range_checks_run() { return range_check_runs.load(std::memory_order_relaxed); }

}  // namespace kvpage
