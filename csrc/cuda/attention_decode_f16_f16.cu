// Decode kernels for float16 caches with float16 queries (see attention_decode_kernels.cuh).
#include "attention_decode_kernels.cuh"

namespace kvpage {
namespace cuda {

template <>
cudaError_t launch_decode<__half, __half>(const AttentionParams& p, const DecodeWork& w,
                                          cudaStream_t stream) {
  return launch_decode_for_head_and_tile<__half, __half>(p, w, stream);
}

}  // namespace cuda
}  // namespace kvpage
