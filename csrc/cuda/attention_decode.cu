// Decode (and SIMT prefill) entry point: picks the launcher of the (query, cache) dtype pair.
// The kernels are in attention_decode_kernels.cuh, instantiated by attention_decode_*.cu; this
// file reads only their footprints (no kernel is instantiated here).
#include <algorithm>

#include "attention_decode_kernels.cuh"

namespace kvpage {
namespace cuda {

bool decode_uses_tensor_cores(const AttentionParams& p) {
  const bool sixteen_bit = p.dtype == DType::kHalf || p.dtype == DType::kBFloat16;
  return sixteen_bit && p.cache_dtype == p.dtype && p.num_heads >= 2 * p.num_kv_heads && p.head_size <= 128;
}

DecodeOccupancy decode_occupancy(const AttentionParams& p, int shared_memory_per_sm) {
  int heads_per_cta = 1, smem = 0, by_registers = 1;
  dispatch_attention_dtypes(p.dtype, p.cache_dtype, [&](auto query, auto cache) {
    visit_decode_kernel<decltype(query), decltype(cache)>(p, [&](auto kernel) {
      using Config = typename decltype(kernel)::Config;
      heads_per_cta = Config::kHeadsPerCta, smem = Config::Ring::kSmemBytes, by_registers = Config::kMinBlocksPerSm;
    });
  });
  const int group = p.num_heads / p.num_kv_heads;
  constexpr int kReservedPerCta = 1024;  // shared memory the runtime keeps per CTA (sm_80 and later)
  return DecodeOccupancy{p.num_kv_heads * ((group + heads_per_cta - 1) / heads_per_cta),
                         std::max(1, std::min(by_registers, shared_memory_per_sm / (smem + kReservedPerCta)))};
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
