// Emulator stand-in: a failed launch (or a kernel the emulator stopped) raises RuntimeError.
#pragma once
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#define C10_CUDA_CHECK(EXPR)                                                        \
  do {                                                                              \
    const cudaError_t kvpage_emu_err = (EXPR);                                      \
    TORCH_CHECK(kvpage_emu_err == cudaSuccess, "CUDA error: ", cudaGetErrorString(kvpage_emu_err)); \
  } while (0)
