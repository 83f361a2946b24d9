// Device helpers shared by the kernels: element conversion, 16-byte vectors, tensor-core and
// async-copy PTX wrappers, and the one place where dtype and head size become template arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernel_params.h"

namespace kvpage {
namespace cuda {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// One 16-byte vector (uint4) of T as floats: 4 for fp32, 8 for fp16/bf16.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
};

template <typename T>
__device__ __forceinline__ void unpack16(const uint4& v, float* f);
template <>
__device__ __forceinline__ void unpack16<float>(const uint4& v, float* f) {
  f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
}
template <>
__device__ __forceinline__ void unpack16<__half>(const uint4& v, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x, f[2 * i + 1] = x.y;
  }
}
template <>
__device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x, f[2 * i + 1] = x.y;
  }
}

// KV streams are read once per CTA: bypass L1 allocation but keep L2 (other query groups of
// the same KV head may follow).
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}

// Two floats as one 32-bit register of two 16-bit values (low half = first), the A-operand
// format of mma.sync.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulate (sm_80+).
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a, uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four transposed 8x8 b16 matrices from shared memory (each lane gives one row address).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// 16-byte global->shared copy; src_bytes == 0 writes zeros without reading src (masked rows).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- Template dispatch: the one place runtime dtype / head size become template arguments. ----

// Head sizes with their own instantiation; any other multiple of 16 (<= 256) runs the next
// larger one with the extra lanes masked, so every supported size has a kernel.
template <typename F>
bool dispatch_head_size(int head_size, F&& f) {
  if (head_size <= 64) return f(std::integral_constant<int, 64>{}), true;
  if (head_size <= 80) return f(std::integral_constant<int, 80>{}), true;
  if (head_size <= 96) return f(std::integral_constant<int, 96>{}), true;
  if (head_size <= 112) return f(std::integral_constant<int, 112>{}), true;
  if (head_size <= 128) return f(std::integral_constant<int, 128>{}), true;
  if (head_size <= 192) return f(std::integral_constant<int, 192>{}), true;
  if (head_size <= 256) return f(std::integral_constant<int, 256>{}), true;
  return false;
}

template <typename F>
bool dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat: return f(float{}), true;
    case DType::kHalf: return f(__half{}), true;
    case DType::kBFloat16: return f(__nv_bfloat16{}), true;
  }
  return false;
}

// Decode CTAs serve up to this many query heads of one GQA group: 1 (MHA), 4 (group 2..4,
// e.g. Llama-3-8B and SmolLM2), 8 (larger groups, in chunks of 8).
template <typename F>
void dispatch_group_tile(int group, F&& f) {
  if (group == 1) return f(std::integral_constant<int, 1>{});
  if (group <= 4) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, 8>{});
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace cuda
}  // namespace kvpage
