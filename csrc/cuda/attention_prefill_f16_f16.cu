// Prefill kernels for float16 caches with float16 queries (see attention_prefill_kernels.cuh).
#include "attention_prefill_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_prefill<__half, __half>(const AttentionParams& p, const PrefillWork& w, cudaStream_t stream) {
  return launch_prefill_for_head<__half, __half>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
