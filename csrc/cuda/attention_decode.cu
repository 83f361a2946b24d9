// Decode (and SIMT prefill) entry point: picks the launcher of the (query, cache) dtype pair.
// The kernels are in attention_decode_kernels.cuh, instantiated by attention_decode_*.cu; this
// file reads only their footprints (no kernel is instantiated here).
#include <algorithm>

#include "attention_decode_kernels.cuh"

namespace kvpage {
namespace cuda {

int decode_ctas_per_row(int num_heads, int num_kv_heads) {
  const int group = num_heads / num_kv_heads;
  int tiles = 0;
  dispatch_group_tile(group, [&](auto gt) { tiles = (group + decltype(gt)::value - 1) / decltype(gt)::value; });
  return num_kv_heads * tiles;
}

bool decode_uses_tensor_cores(const AttentionParams& p) {
  const bool sixteen_bit = p.dtype == DType::kHalf || p.dtype == DType::kBFloat16;
  return sixteen_bit && p.cache_dtype == p.dtype && p.num_heads >= 2 * p.num_kv_heads && p.head_size <= 128;
}

int decode_ctas_per_sm(const AttentionParams& p, int shared_memory_per_sm) {
  int smem = 0, by_registers = 1;
  dispatch_attention_dtypes(p.dtype, p.cache_dtype, [&](auto query, auto cache) {
    visit_decode_kernel<decltype(query), decltype(cache)>(p, [&](auto kernel) {
      using Config = typename decltype(kernel)::Config;
      smem = Config::Ring::kSmemBytes, by_registers = Config::kMinBlocksPerSm;
    });
  });
  constexpr int kReservedPerCta = 1024;  // shared memory the runtime keeps per CTA (sm_80 and later)
  return std::max(1, std::min(by_registers, shared_memory_per_sm / (smem + kReservedPerCta)));
}

cudaError_t launch_paged_decode(const AttentionParams& p, const DecodeWork& w, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_attention_dtypes(p.dtype, p.cache_dtype, [&](auto query, auto cache) {
    err = launch_decode<decltype(query), decltype(cache)>(p, w, stream);
  });
  return err;
}

}  // namespace cuda
}  // namespace kvpage
