// Prepended to the CUDA op glue (ops_*.cpp) in the emulator build: ATen first, then the one
// rewrite the glue needs to run on CPU tensors. Tensors handed to the emulated ops are CPU
// tensors standing in for device memory, so "is it a CUDA tensor" reads "is it a CPU tensor".
#pragma once

#include <ATen/ATen.h>

#define is_cuda() is_cpu()
