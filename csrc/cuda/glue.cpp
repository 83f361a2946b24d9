#include "glue.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cstring>

namespace kvpage {
namespace cuda {

namespace {

// An attribute of the current device, read once per device (the query is a driver call).
int cached_device_attribute(std::atomic<int> (&cache)[64], cudaDeviceAttr attribute) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && cache[device].load(std::memory_order_relaxed) > 0) return cache[device];
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  if (device < 64) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

}  // namespace

int num_sms() {
  static std::atomic<int> cache[64] = {};
  return cached_device_attribute(cache, cudaDevAttrMultiProcessorCount);
}

int compute_capability_major() {
  static std::atomic<int> cache[64] = {};
  return cached_device_attribute(cache, cudaDevAttrComputeCapabilityMajor);
}

int shared_memory_per_sm() {
  static std::atomic<int> cache[64] = {};
  return cached_device_attribute(cache, cudaDevAttrMaxSharedMemoryPerMultiprocessor);
}

at::Tensor upload_words(const std::vector<int64_t>& words, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(words.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), words.data(), words.size() * sizeof(int64_t));
  return host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
}

}  // namespace cuda
}  // namespace kvpage
