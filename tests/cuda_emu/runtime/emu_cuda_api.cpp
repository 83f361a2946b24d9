// The few CUDA runtime calls the op glue and the launchers make, answered by the emulator: the
// sticky launch error, the dynamic shared memory opt-in, one device, one address space.
#include <cstring>

#include "emu_internal.h"

using emu::detail::E;

extern "C" {
cudaError_t cudaGetLastError() {
  auto& e = E();
  const cudaError_t err = e.last_error;
  e.last_error = cudaSuccess;
  return err;
}
cudaError_t cudaPeekAtLastError() { return E().last_error; }
const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : E().last_message.empty() ? "emu error" : E().last_message.c_str();
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > emu::detail::kMaxSmemOptIn) return cudaErrorInvalidValue;
    E().smem_limits[func] = static_cast<size_t>(value);
  }
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? E().num_sms : 0;
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned int) {
  *device_ptr = host_ptr;  // one address space
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind, cudaStream_t) {
  std::memcpy(dst, src, count);
  return cudaSuccess;
}
}
