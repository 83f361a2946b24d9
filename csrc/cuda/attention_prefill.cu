// Tensor-core prefill entry point: picks the launcher of the (query, cache) dtype pair. The
// kernels are in attention_prefill_kernels.cuh, instantiated by attention_prefill_*.cu.
#include "attention_prefill.h"

namespace kvpage {
namespace cuda {

// fp16 / bf16 queries over their own dtype's cache or an fp8 one. fp32 queries (fp32 caches,
// or fp32 over fp8) prefill through the SIMT decode kernel, one CTA per query token: tensor
// cores would round fp32 queries to 16 bits, which fp32 callers do not expect.
bool prefill_uses_tensor_cores(const AttentionParams& p) {
  const bool sixteen_bit = p.dtype == DType::kHalf || p.dtype == DType::kBFloat16;
  return sixteen_bit && (p.cache_dtype == p.dtype || p.cache_dtype == DType::kFp8E4M3);
}

cudaError_t launch_paged_prefill(const AttentionParams& p, const PrefillWork& w, cudaStream_t stream) {
  if (!prefill_uses_tensor_cores(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0 || p.num_seqs == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_attention_dtypes(p.dtype, p.cache_dtype, [&](auto query, auto cache) {
    if constexpr (!std::is_same<decltype(query), float>::value) {
      err = launch_prefill<decltype(query), decltype(cache)>(p, w, stream);
    }
  });
  return err;
}

}  // namespace cuda
}  // namespace kvpage
