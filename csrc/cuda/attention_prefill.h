// The tensor-core prefill launchers, one per (query dtype, cache dtype) pair. Each is defined in
// its own attention_prefill_<cache>_<query>.cu (from attention_prefill_kernels.cuh), so a
// many-core build compiles the pairs in parallel; attention_prefill.cu picks one.
#pragma once

#include "device_utils.cuh"

namespace kvpage {
namespace cuda {

// T: query / out element type (fp16 / bf16); Cache: T, or Fp8E4M3.
template <typename T, typename Cache>
cudaError_t launch_prefill(const AttentionParams& p, const PrefillWork& w, cudaStream_t stream);

template <>
cudaError_t launch_prefill<__half, __half>(const AttentionParams&, const PrefillWork&, cudaStream_t);
template <>
cudaError_t launch_prefill<__nv_bfloat16, __nv_bfloat16>(const AttentionParams&, const PrefillWork&, cudaStream_t);
template <>
cudaError_t launch_prefill<__half, Fp8E4M3>(const AttentionParams&, const PrefillWork&, cudaStream_t);
template <>
cudaError_t launch_prefill<__nv_bfloat16, Fp8E4M3>(const AttentionParams&, const PrefillWork&, cudaStream_t);

}  // namespace cuda
}  // namespace kvpage
