// Prefill kernels for fp8 (e4m3) caches with bfloat16 queries (see attention_prefill_kernels.cuh).
#include "attention_prefill_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_prefill<__nv_bfloat16, Fp8E4M3>(const AttentionParams& p, const PrefillWork& w, cudaStream_t stream) {
  return launch_prefill_for_head<__nv_bfloat16, Fp8E4M3>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
