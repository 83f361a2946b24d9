// The decode launchers, one per (query dtype, cache dtype) pair. Each is defined in its own
// attention_decode_<cache>_<query>.cu (from attention_decode_kernels.cuh), so a many-core
// build compiles the ~21 kernels of each pair in parallel; attention_decode.cu picks one.
#pragma once

#include "device_utils.cuh"

namespace kvpage {
namespace cuda {

// T: query / out element type; Cache: K/V cache element type (T, or Fp8E4M3).
template <typename T, typename Cache>
cudaError_t launch_decode(const AttentionParams& p, const DecodeWork& w, cudaStream_t stream);

// Caches of the query's own dtype.
template <>
cudaError_t launch_decode<float, float>(const AttentionParams&, const DecodeWork&, cudaStream_t);
template <>
cudaError_t launch_decode<__half, __half>(const AttentionParams&, const DecodeWork&, cudaStream_t);
template <>
cudaError_t launch_decode<__nv_bfloat16, __nv_bfloat16>(const AttentionParams&, const DecodeWork&,
                                                        cudaStream_t);
// fp8 caches, any query dtype.
template <>
cudaError_t launch_decode<float, Fp8E4M3>(const AttentionParams&, const DecodeWork&, cudaStream_t);
template <>
cudaError_t launch_decode<__half, Fp8E4M3>(const AttentionParams&, const DecodeWork&, cudaStream_t);
template <>
cudaError_t launch_decode<__nv_bfloat16, Fp8E4M3>(const AttentionParams&, const DecodeWork&, cudaStream_t);

}  // namespace cuda
}  // namespace kvpage
