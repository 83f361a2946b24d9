// Prefill kernels for fp8 (e4m3) caches with float16 queries (see attention_prefill_kernels.cuh).
#include "attention_prefill_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_prefill<__half, Fp8E4M3>(const AttentionParams& p, const PrefillWork& w, cudaStream_t stream) {
  return launch_prefill_for_head<__half, Fp8E4M3>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
