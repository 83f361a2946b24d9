// Decode kernels for bfloat16 caches with bfloat16 queries (see attention_decode_kernels.cuh).
#include "attention_decode_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_decode<__nv_bfloat16, __nv_bfloat16>(const AttentionParams& p, const DecodeWork& w,
                                                        cudaStream_t stream) {
  return launch_decode_for_head_and_tile<__nv_bfloat16, __nv_bfloat16>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
