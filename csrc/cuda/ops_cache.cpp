// CUDA cache ops: reshape_and_cache (scatter by slot mapping; quantises into fp8 caches),
// copy_blocks (all layers, one launch) and swap_blocks (GPU <-> pinned host, one launch).
// block_mapping is a CPU tensor, so its checks never sync; the (pointer table, pairs) go to the
// device in one async upload.
// Swaps are ordered on the current stream like any kernel: a caller that reads swapped-out host
// blocks on the CPU synchronises that stream first.
#include <ATen/ATen.h>

#include <algorithm>

#include "../checks.h"
#include "../ops.h"
#include "glue.h"

namespace kvpage {
namespace cuda {
namespace {

// A tensor's address as the device sees it: device memory as is, pinned host memory through its
// mapping (with unified addressing the same value). 0 when the host memory is not mapped.
int64_t device_address(const at::Tensor& t) {
  if (t.is_cuda()) return reinterpret_cast<int64_t>(t.data_ptr());
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, t.data_ptr(), 0) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later checks don't see it
    return 0;
  }
  return reinterpret_cast<int64_t>(mapped);
}

void push_tensor(std::vector<int64_t>& words, int64_t src, int64_t dst, int64_t bytes, int64_t src_blocks,
                 int64_t dst_blocks) {
  words.insert(words.end(), {src, dst, bytes, src_blocks, dst_blocks});
}

// Appends the pairs, uploads (table, pairs) in one copy and launches one block-copy kernel.
void run_block_copy(std::vector<int64_t>& words, int num_tensors, const at::Tensor& block_mapping,
                    int64_t max_bytes, bool aligned, const at::Device& device) {
  const at::Tensor m = block_mapping.contiguous();
  const int64_t n = m.size(0);
  words.insert(words.end(), m.data_ptr<int64_t>(), m.data_ptr<int64_t>() + 2 * n);
  const at::Tensor dev = upload_words(words, device);
  const int64_t* base = dev.data_ptr<int64_t>();
  C10_CUDA_CHECK(launch_block_copy(reinterpret_cast<const BlockCopyTensor*>(base), num_tensors,
                                   base + 5 * int64_t(num_tensors), n, max_bytes, aligned, current_stream()));
}

// key or value (any strides the checks allow) and the cache it goes into. scale: what one fp8
// code is worth; the kernel multiplies by float(1.0 / scale), the reciprocal rounded once as in
// reference.quantize_fp8.
CacheWriteSource write_source(const at::Tensor& src, at::Tensor& cache, double scale) {
  CacheWriteSource s{};
  s.data = src.data_ptr();
  s.token_stride = src.stride(0), s.head_stride = src.stride(1);
  s.dtype = to_dtype(src.scalar_type());
  const int64_t vec = 16 / src.element_size();
  s.vectorized = aligned16(s.data) && s.token_stride % vec == 0 && s.head_stride % vec == 0;
  s.inverse_scale = static_cast<float>(1.0 / scale);
  s.cache = cache.data_ptr();
  return s;
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping, bool check_ranges,
                       double k_scale, double v_scale) {
  // The slot range check copies slot_mapping to the host: the documented sync.
  const CacheShape cache = check_cache_write(key, value, key_cache, value_cache, slot_mapping, check_ranges,
                                             k_scale, v_scale);
  TORCH_CHECK_VALUE(aligned16(key_cache.data_ptr()) && aligned16(value_cache.data_ptr()),
                    "key_cache and value_cache must be 16-byte aligned (use allocate_kv_cache)");
  if (key.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());

  CacheWriteParams p{};
  p.key = write_source(key, key_cache, k_scale);
  p.value = write_source(value, value_cache, v_scale);
  p.cache_dtype = to_dtype(key_cache.scalar_type());
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = key.size(0), p.num_slots = cache.num_blocks * cache.block_size;
  p.num_kv_heads = static_cast<int>(cache.num_kv_heads);
  p.block_size = static_cast<int>(cache.block_size), p.head_size = static_cast<int>(cache.head_size);
  C10_CUDA_CHECK(launch_reshape_and_cache(p, current_stream()));
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const at::Tensor& block_mapping, bool check_ranges) {
  const int64_t num_blocks = check_layer_caches(key_caches, value_caches);
  // block_mapping is CPU data: checking it never syncs.
  check_block_mapping(block_mapping, num_blocks, num_blocks, check_ranges && num_blocks > 0, true);
  check_mapping_not_written(block_mapping, key_caches, "key_caches");
  check_mapping_not_written(block_mapping, value_caches, "value_caches");
  if (key_caches.empty()) return;
  TORCH_CHECK_VALUE(key_caches[0].is_cuda(), "key_caches must be CUDA tensors in a CUDA copy_blocks");
  if (block_mapping.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(key_caches[0].device());

  const int64_t bytes = block_bytes(key_caches[0]);
  bool aligned = bytes % 16 == 0;
  std::vector<int64_t> words;
  for (size_t i = 0; i < key_caches.size(); ++i) {
    for (const at::Tensor* t : {&key_caches[i], &value_caches[i]}) {
      const int64_t addr = reinterpret_cast<int64_t>(t->data_ptr());
      aligned = aligned && addr % 16 == 0;
      push_tensor(words, addr, addr, bytes, num_blocks, num_blocks);
    }
  }
  run_block_copy(words, as_int(2 * int64_t(key_caches.size()), "number of caches"), block_mapping, bytes,
                 aligned, key_caches[0].device());
}

void swap_blocks(at::TensorList src, at::TensorList dst, const at::Tensor& block_mapping,
                 bool check_ranges) {
  const auto [src_blocks, dst_blocks] = check_swap_pairs(src, dst);
  c10::optional<at::Device> device;
  for (size_t i = 0; i < src.size(); ++i) {
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{src[i], "src"}, {dst[i], "dst"}}) {
      if (t.is_cuda()) {
        if (!device) device = t.device();
        TORCH_CHECK_VALUE(t.device() == *device, name, "[", i, "] is on ", t.device(),
                          " but the swap runs on ", *device);
      } else {
        TORCH_CHECK_VALUE(t.is_cpu() && t.is_pinned(), name, "[", i,
                          "] must be a CUDA tensor or pinned CPU memory (allocate the swap space "
                          "with pin_memory=True)");
      }
    }
  }
  check_block_mapping(block_mapping, src_blocks, dst_blocks, check_ranges, false);  // CPU data: no sync
  check_mapping_not_written(block_mapping, dst, "dst");
  if (src.empty() || block_mapping.size(0) == 0) return;
  TORCH_CHECK_VALUE(device.has_value(), "swap_blocks on CUDA needs a CUDA tensor in src or dst");
  const c10::cuda::CUDAGuard guard(*device);

  std::vector<int64_t> words;
  int64_t max_bytes = 0;
  bool aligned = true;
  const at::Tensor m = block_mapping.contiguous();
  const int64_t* pairs = m.data_ptr<int64_t>();
  for (size_t i = 0; i < src.size(); ++i) {
    const int64_t bytes = block_bytes(src[i]);
    const int64_t s = device_address(src[i]), d = device_address(dst[i]);
    if (s == 0 || d == 0) {
      // Pinned memory the device cannot address directly (not expected with unified
      // addressing): async copies per block for this tensor, bounds checked here since the
      // kernel's guards do not cover this path.
      TORCH_WARN_ONCE("swap_blocks: pinned memory is not mapped into the device; using per-block copies");
      for (int64_t k = 0; k < m.size(0); ++k) {
        if (pairs[2 * k] < 0 || pairs[2 * k] >= src[i].size(0) || pairs[2 * k + 1] < 0 ||
            pairs[2 * k + 1] >= dst[i].size(0)) continue;
        C10_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst[i].data_ptr()) + pairs[2 * k + 1] * bytes,
                                       static_cast<const char*>(src[i].data_ptr()) + pairs[2 * k] * bytes,
                                       bytes, cudaMemcpyDefault, current_stream()));
      }
      continue;
    }
    aligned = aligned && bytes % 16 == 0 && s % 16 == 0 && d % 16 == 0;
    max_bytes = std::max(max_bytes, bytes);
    push_tensor(words, s, d, bytes, src[i].size(0), dst[i].size(0));
  }
  const int num_tensors = static_cast<int>(words.size() / 5);
  if (num_tensors > 0) run_block_copy(words, num_tensors, block_mapping, max_bytes, aligned, *device);
}

}  // namespace cuda
}  // namespace kvpage
