// Planted bugs, written as CUDA kernels, that the emulator's own tests (tests/cuda_emu/
// test_emu_probes.py) expect it to expose: a read past a tensor (for the ASan build), a shared
// memory read with no barrier after the write, a barrier half the block never reaches, a read of
// a cp.async destination before its wait_group, and dynamic shared memory beyond the default
// 48 KiB without cudaFuncSetAttribute. Plus cross-checks: the emulator compiles the sm_80 path
// of fp8x2_to_half2 (no __CUDA_ARCH__ here); it must equal CUDA's own conversion, the sm_89+ path.
// And ldmatrix_x4 / ldmatrix_x4_trans and movmatrix_trans must hand each lane the elements the PTX
// ISA assigns it.
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

// One warp reads a 16 x 16 tile of distinct b16 values (rows kLd elements apart) as four 8x8
// matrices, matrix j at rows 8 (j % 2), columns 8 (j / 2): lane l addresses row l % 8 of matrix
// l / 8. Counts the registers that differ from the PTX ISA's fragments: plain, r[j] = matrix j's
// row l / 4, columns 2 (l % 4) and + 1; .trans, its column l / 4, rows 2 (l % 4) and + 1.
__global__ void ldmatrix_kernel(int* mismatches) {
  constexpr int kLd = 24;  // padded like the prefill tiles: rows stay 16-byte aligned
  alignas(16) __shared__ uint16_t tile[16 * kLd];
  ::emu::shared_decl(&tile, sizeof(tile));
  const int lane = threadIdx.x;
  for (int i = lane; i < 16 * kLd; i += 32) tile[i] = static_cast<uint16_t>(i);
  __syncthreads();
  const uint16_t* row = &tile[((lane / 8 % 2) * 8 + lane % 8) * kLd + lane / 16 * 8];
  uint32_t plain[4], trans[4];
  kvpage::cuda::ldmatrix_x4(plain, row);
  kvpage::cuda::ldmatrix_x4_trans(trans, row);
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 4; ++j) {
    auto at = [&](int r, int c) { return uint32_t(tile[((j % 2) * 8 + r) * kLd + j / 2 * 8 + c]); };
    *mismatches += plain[j] != (at(g, 2 * t) | at(g, 2 * t + 1) << 16);
    *mismatches += trans[j] != (at(2 * t, g) | at(2 * t + 1, g) << 16);
  }
}

// One warp transposes an 8x8 b16 matrix of distinct values M[r][c] = 8r + c held as mma fragments
// (lane l: row l / 4, columns 2 (l % 4) and + 1). Counts the lanes that do not receive column
// l / 4, rows 2 (l % 4) and + 1, as the PTX ISA's movmatrix.trans assigns.
__global__ void movmatrix_kernel(int* mismatches) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto at = [](int r, int c) { return uint32_t(8 * r + c); };
  const uint32_t mine = at(g, 2 * t) | at(g, 2 * t + 1) << 16;
  const uint32_t moved = kvpage::cuda::movmatrix_trans(mine);
  *mismatches += moved != (at(2 * t, g) | at(2 * t + 1, g) << 16);  // a block's fibers share one OS thread
}

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

int probe_ldmatrix_mismatches() {
  int mismatches = 0;
  launch(&ldmatrix_kernel, dim3(1), dim3(32))(&mismatches);
  return cudaGetLastError() == cudaSuccess ? mismatches : -1;
}

int probe_movmatrix_mismatches() {
  int mismatches = 0;
  launch(&movmatrix_kernel, dim3(1), dim3(32))(&mismatches);
  return cudaGetLastError() == cudaSuccess ? mismatches : -1;
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
