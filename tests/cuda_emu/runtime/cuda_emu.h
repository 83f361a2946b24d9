// kvpage's CUDA kernels compiled as ordinary C++ and run on the CPU, for tests on machines without
// a GPU. Force-included (-include) before every source of the emulator build; build_emu.py has
// already rewritten `k<<<grid, block, smem, stream>>>(args)` into emu::launch(...)(args) and
// `__shared__` declarations into registered thread_local statics.
//
// Model: a launch spreads its blocks over OS threads (an OpenMP team, torch's thread count), in no
// fixed order; each CUDA thread of a block is a fiber with its own stack, switched cooperatively
// on the one OS thread that runs the block. A fiber runs until it reaches a block barrier or a
// warp collective (shuffle, ballot, mma.sync, ldmatrix); a collective completes when every lane of
// its warp has arrived, a barrier when every thread of the block has. Which runnable fiber goes
// next is drawn at random (seeded per launch and block), so a read of shared memory that another
// thread writes without a barrier in between sees a different value from run to run. Shared memory
// starts every block filled with 0xFF bytes (NaN as floats), cp.async copies land only at the
// cp.async.wait_group that covers them, and a barrier that not every thread reaches, or a
// collective with a lane that has exited, is an error, as is dynamic shared memory beyond what the
// kernel opted into. What this cannot see: timing, tensor-core rounding (emulated in fp32), and
// global-memory races between blocks (blocks do run side by side here, but a race shows only by
// chance).
#pragma once

#define KVPAGE_CUDA_EMU 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "emu_api.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static thread_local


// ---- CUDA's built-in variables and device intrinsics -----------------------------------------
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())
constexpr int warpSize = 32;

inline void __syncthreads() { ::emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::emu::warp_collective(::emu::Op::kSyncWarp, mask, nullptr, nullptr);
}
template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::emu::shuffle(mask, var, 0, src_lane, width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::emu::shuffle(mask, var, 1, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::emu::shuffle(mask, var, 2, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::emu::shuffle(mask, var, 3, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  int p = predicate != 0;
  ::emu::warp_collective(::emu::Op::kBallot, mask, nullptr, &p);
  return static_cast<unsigned>(p);
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == __ballot_sync(mask, 1); }

// Cache-hinted loads and stores: plain accesses here.
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline T __ldcv(const T* p) { return *p; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stwt(T* p, T v) { *p = v; }

inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
// PTX prmt: byte i of the result is byte (s >> 4i) & 7 of the 8-byte value {y, x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline float __uint_as_float(unsigned x) { return ::emu::from_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return static_cast<unsigned>(::emu::to_bits(x)); }
inline float __int_as_float(int x) { return ::emu::from_bits<float>(static_cast<unsigned>(x)); }
inline int __float_as_int(float x) { return static_cast<int>(::emu::to_bits(x)); }
// Built with -ffp-contract=off: a product is never fused into an add.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }

// CUDA's device min / max accept mixed integer types (promoted), unlike std::min.
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline auto min(A a, B b) -> std::common_type_t<A, B> {
  return a < b ? a : b;
}
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline auto max(A a, B b) -> std::common_type_t<A, B> {
  return a < b ? b : a;
}

// cuda_runtime.h's typed overload exists only for nvcc.
template <typename... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
