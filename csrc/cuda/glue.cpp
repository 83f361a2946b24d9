#include "glue.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cstring>

namespace kvpage {
namespace cuda {

int num_sms() {
  static std::atomic<int> cache[64] = {};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && cache[device].load(std::memory_order_relaxed) > 0) return cache[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

at::Tensor upload_words(const std::vector<int64_t>& words, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(words.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), words.data(), words.size() * sizeof(int64_t));
  return host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
}

}  // namespace cuda
}  // namespace kvpage
