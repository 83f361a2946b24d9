// Decode kernels for fp8 (e4m3) caches with float32 queries (see attention_decode_kernels.cuh).
#include "attention_decode_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_decode<float, Fp8E4M3>(const AttentionParams& p, const DecodeWork& w,
                                          cudaStream_t stream) {
  return launch_decode_for_head_and_tile<float, Fp8E4M3>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
