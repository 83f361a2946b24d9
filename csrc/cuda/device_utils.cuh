// Device helpers shared by the kernels: element conversion (fp8 codes included), 16- and 8-byte
// vectors, tensor-core and async-copy PTX wrappers, and the one place where dtypes and head size
// become template arguments. Each PTX wrapper has a KVPAGE_CUDA_EMU branch: the CPU emulator of
// tests/cuda_emu runs these kernels without a GPU and supplies the warp-level operations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernel_params.h"

namespace kvpage {
namespace cuda {

constexpr int kWarpSize = 32;
// The attention kernels keep logits in the log2 domain (q pre-scaled by scale * log2(e)).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A row's log-sum-exp in natural units (AttentionParams::lse) from its log2-domain softmax state:
// running max m and sum l of exp2(s - m); -inf where it saw no key.
__device__ __forceinline__ float natural_lse(float m, float l) {
  return l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// Gemma 2's logit softcapping on a log2-domain logit: cap = c * log2(e) (AttentionParams::softcap)
// turns c * tanh(s / c) of the natural logit s into the same form; 0: none. Before any mask (tanh
// would make a masked -inf a finite -cap). tanh(x) = 1 - 2 / (e^2x + 1): one exp2f and a division,
// few registers (tanhf's polynomial spilled the decode and prefill kernels, which sit at their
// register limits), exact at +-inf and within ~1e-7 of tanh elsewhere.
__device__ __forceinline__ float soft_cap(float s, float cap) {
  if (cap <= 0.f) return s;
  return cap * (1.f - 2.f / (exp2f(2.f * kLog2e * (s / cap)) + 1.f));
}

// A row's finished log2-domain softmax state with its head's sink folded in: one more logit
// (sinks[head], natural units) in the denominator that brings no value (gpt-oss's s_aux). m and l
// move to cover it; acc_factor is what the row's accumulator (sum of exp2(s - m_old) v) then takes.
// Once per row, after every key (partitions merged first), so the sink counts once.
struct RowTotal {
  float m, l, acc_factor;
};
__device__ __forceinline__ RowTotal with_sink(const float* sinks, int head, float m, float l) {
  if (sinks == nullptr) return {m, l, 1.f};
  const float sink = sinks[head] * kLog2e, m_new = fmaxf(m, sink);
  if (m_new == -INFINITY) return {m, l, 1.f};
  const float alpha = exp2f(m - m_new);  // 0 where the row saw no key
  return {m_new, l * alpha + exp2f(sink - m_new), alpha};
}

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

// An fp8 cache's element: one float8_e4m3fn code (value = code * the cache's scale). A type of
// its own so templates can tell caches apart; the bytes are CUDA's __nv_fp8_storage_t.
struct Fp8E4M3 {
  __nv_fp8_storage_t code;
};
static_assert(sizeof(Fp8E4M3) == 1, "one byte per fp8 code");

// Packed 32-bit words -> floats, exactly: 1 fp32, 2 fp16 / bf16 or 4 fp8 values per word.
template <typename T>
__device__ __forceinline__ void unpack_word(uint32_t w, float* f);
template <>
__device__ __forceinline__ void unpack_word<float>(uint32_t w, float* f) {
  f[0] = __uint_as_float(w);
}
template <>
__device__ __forceinline__ void unpack_word<__half>(uint32_t w, float* f) {
  const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w));
  f[0] = x.x, f[1] = x.y;
}
template <>
__device__ __forceinline__ void unpack_word<__nv_bfloat16>(uint32_t w, float* f) {
  const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  f[0] = x.x, f[1] = x.y;
}

// Two e4m3 codes (the low 16 bits of pair, first code lowest) as an exact half2.
__device__ __forceinline__ __half2 fp8x2_to_half2(uint32_t pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // Ada / Hopper convert in hardware (one cvt.f16x2.e4m3x2).
  return __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3));
#else
  // Ampere has no fp8 instructions: each code's sign, exponent and mantissa bits, moved into an
  // fp16's fields (code << 8, magnitude shifted right by one), form an fp16 worth exactly 2^-8
  // of the code's value, subnormals included (e4m3's bias is 8 below fp16's); the multiply by
  // 256 is exact. NaN codes (0x7f, 0xff) read as +-480 here, as in the CPU kernels;
  // reshape_and_cache never writes them (it saturates).
  const uint32_t r = __byte_perm(pair, 0u, 0x1404);  // bytes [0, code0, 0, code1]
  const uint32_t bits = (r & 0x80008000u) | ((r & 0x7f007f00u) >> 1);
  return __hmul2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(256.f));
#endif
}
template <>
__device__ __forceinline__ void unpack_word<Fp8E4M3>(uint32_t w, float* f) {
  const float2 lo = __half22float2(fp8x2_to_half2(w));
  const float2 hi = __half22float2(fp8x2_to_half2(w >> 16));
  f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
}

// Two e4m3 codes (low 16 bits, first code lowest) as one 32-bit word of two exact T values
// (fp16 or bf16: both hold every e4m3 value exactly), the operand format of mma.sync.
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t pair);
template <>
__device__ __forceinline__ uint32_t fp8x2_to<__half>(uint32_t pair) {
  const __half2 h = fp8x2_to_half2(pair);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t fp8x2_to<__nv_bfloat16>(uint32_t pair) {
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(fp8x2_to_half2(pair)));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Eight e4m3 codes (8 bytes) as eight exact T values (one 16-byte chunk).
template <typename T>
__device__ __forceinline__ uint4 fp8x8_to(const uint2& codes) {
  return make_uint4(fp8x2_to<T>(codes.x), fp8x2_to<T>(codes.x >> 16), fp8x2_to<T>(codes.y),
                    fp8x2_to<T>(codes.y >> 16));
}

// A loaded vector V (uint4: 16 bytes, uint2: 8 bytes) of T elements as sizeof(V) / sizeof(T) floats.
template <typename T, typename V>
__device__ __forceinline__ void unpack(const V& v, float* f) {
  constexpr int kWords = sizeof(V) / 4, kPerWord = 4 / sizeof(T);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < kWords; ++i) unpack_word<T>(w[i], f + i * kPerWord);
}

// Eight floats times inverse_scale as eight e4m3 codes (first in the lowest byte): round to
// nearest even, saturated to +-448 (SATFINITE: infinities too), the CPU kernels' and
// reference.quantize_fp8's formula. The product is a plain fp32 multiply, never fused.
__device__ __forceinline__ uint2 quantize_fp8x8(const float* f, float inverse_scale) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const float2 x = make_float2(__fmul_rn(f[i], inverse_scale), __fmul_rn(f[i + 1], inverse_scale));
    const uint32_t pair = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);  // x.x in the low byte
    w[i / 4] |= pair << (16 * ((i / 2) % 2));
  }
  return make_uint2(w[0], w[1]);
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
#ifdef KVPAGE_CUDA_EMU
  emu::mma_16816(d, a, b0, b1, /*bf16=*/false);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a, uint32_t b0,
                                                         uint32_t b1) {
#ifdef KVPAGE_CUDA_EMU
  emu::mma_16816(d, a, b0, b1, /*bf16=*/true);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory: lane i gives the (16-byte aligned) address of row
// i % 8 of matrix i / 8; r[j] is matrix j's row lane / 4, columns 2 (lane % 4) and + 1, which is
// an mma A or B fragment register read from a row-major tile (B: rows = n, e.g. K's keys).
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* row_addr) {
#ifdef KVPAGE_CUDA_EMU
  emu::ldmatrix_x4(r, row_addr);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
#endif
}

// The same, transposed: r[j] is matrix j's column lane / 4, rows 2 (lane % 4) and + 1 (a B
// fragment from a tile stored k-major, e.g. V's rows = keys).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* row_addr) {
#ifdef KVPAGE_CUDA_EMU
  emu::ldmatrix_x4_trans(r, row_addr);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
#endif
}

// An 8x8 b16 matrix held as mma fragments (lane l: row l / 4, columns 2 (l % 4) and + 1, low
// half first), transposed across the warp: lane l receives column l / 4, rows 2 (l % 4) and + 1.
// Turns an accumulator tile, packed to 16 bits, into an operand of the transposed product.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
#ifdef KVPAGE_CUDA_EMU
  return emu::movmatrix_trans(x);
#else
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
#endif
}

// 16-byte global->shared copy; src_bytes == 0 writes zeros without reading src (masked rows).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef KVPAGE_CUDA_EMU
  emu::cp_async16(smem, gmem, valid);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef KVPAGE_CUDA_EMU
  emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef KVPAGE_CUDA_EMU
  emu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Programmatic dependent launch (Hopper): a kernel launched with launch_overlapping may start
// while the kernel before it on the stream has CTAs left, once each of those has called
// allow_dependent_launch (or exited); before reading what that kernel wrote it must call
// wait_for_prerequisite_grid, which waits for its completion and its memory. No-ops before sm_90
// and in the emulator.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
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

// The compute dtypes (query, out, keys / values written into a cache); false for kFp8E4M3.
template <typename F>
bool dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat: return f(float{}), true;
    case DType::kHalf: return f(__half{}), true;
    case DType::kBFloat16: return f(__nv_bfloat16{}), true;
    case DType::kFp8E4M3: break;
  }
  return false;
}

// Attention's (query / out type, cache element type): the query's own dtype, or fp8 codes with
// any query dtype. false for any other pair.
template <typename F>
bool dispatch_attention_dtypes(DType query, DType cache, F&& f) {
  if (cache == DType::kFp8E4M3) return dispatch_dtype(query, [&](auto q) { f(q, Fp8E4M3{}); });
  return cache == query && dispatch_dtype(query, [&](auto q) { f(q, q); });
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
