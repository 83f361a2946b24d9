// Planted bugs, written as CUDA kernels, that the emulator's own tests (tests/cuda_emu/
// test_emu_probes.py) expect it to expose: a read past a tensor (for the ASan build), a shared
// memory read with no barrier after the write, a barrier half the block never reaches, a read of
// a cp.async destination before its wait_group, and dynamic shared memory beyond the default
// 48 KiB without cudaFuncSetAttribute. Plus one cross-check: the emulator compiles the sm_80 path
// of fp8x2_to_half2 (no __CUDA_ARCH__ here); it must equal CUDA's own conversion, the sm_89+ path.
#include "cuda_emu.h"

#include <string>

#include "device_utils.cuh"  // the staged copy of csrc/cuda's
#include "emu_runtime.h"

namespace {

__global__ void overrun_kernel(const float* x, int offset, float* sink) { *sink += x[threadIdx.x + offset]; }

// Thread 0 publishes a value; the others read it with no __syncthreads in between.
__global__ void missing_barrier_kernel(int* stale_reads) {
  __shared__ float value;
  ::emu::shared_decl(&value, sizeof(value));
  if (threadIdx.x == 0) value = 1.f;
  if (threadIdx.x != 0 && value != 1.f) ++*stale_reads;
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x % 2) return;
  __syncthreads();
}

// Every thread copies 16 bytes with cp.async and reads them before waiting.
__global__ void early_cp_async_read_kernel(const uint4* src, int* stale_reads) {
  __shared__ uint4 dst[64];
  ::emu::shared_decl(&dst, sizeof(dst));
  ::emu::cp_async16(&dst[threadIdx.x], &src[threadIdx.x], true);
  ::emu::cp_async_commit();
  if (dst[threadIdx.x].x != src[threadIdx.x].x) ++*stale_reads;
  ::emu::cp_async_wait(0);
}

__global__ void big_smem_kernel() {}

std::string check(cudaError_t err) { return err == cudaSuccess ? "" : cudaGetErrorString(err); }

}  // namespace

namespace emu {

float probe_overrun(const float* x, int offset) {
  float sink = 0.f;
  launch(&overrun_kernel, dim3(1), dim3(32))(x, offset, &sink);
  return sink;
}

int probe_missing_barrier() {
  int stale = 0;
  launch(&missing_barrier_kernel, dim3(1), dim3(128))(&stale);
  return stale;
}

std::string probe_divergent_barrier() {
  launch(&divergent_barrier_kernel, dim3(1), dim3(64))();
  return check(cudaGetLastError());
}

int probe_early_cp_async_read() {
  uint4 src[64];
  for (unsigned i = 0; i < 64; ++i) src[i] = make_uint4(i, i, i, i);
  int stale = 0;
  launch(&early_cp_async_read_kernel, dim3(1), dim3(64))(src, &stale);
  return stale;
}

std::string probe_smem_without_opt_in() {
  launch(&big_smem_kernel, dim3(1), dim3(32), 64 * 1024)();
  return check(cudaGetLastError());
}

int probe_fp8_conversion_mismatches() {
  int mismatches = 0;
  for (uint32_t pair = 0; pair < 0x10000; ++pair) {
    if ((pair & 0x7f) == 0x7f || (pair >> 8 & 0x7f) == 0x7f) continue;  // NaN codes: +-480 vs NaN, by design
    const __half2 bit_trick = kvpage::cuda::fp8x2_to_half2(pair);
    const __half2_raw cuda = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
    uint32_t a, b = uint32_t(cuda.x) | uint32_t(cuda.y) << 16;
    std::memcpy(&a, &bit_trick, 4);
    mismatches += a != b;
  }
  return mismatches;
}

}  // namespace emu
