// Decode kernels for fp8 (e4m3) caches with bfloat16 queries (see attention_decode_kernels.cuh).
#include "attention_decode_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_decode<__nv_bfloat16, Fp8E4M3>(const AttentionParams& p, const DecodeWork& w,
                                                  cudaStream_t stream) {
  return launch_decode_for_head_and_tile<__nv_bfloat16, Fp8E4M3>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
