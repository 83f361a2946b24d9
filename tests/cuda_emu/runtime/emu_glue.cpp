// Emulator versions of csrc/cuda/glue.cpp's device queries: an H100 / H200 (sm_90, the SM count
// emu::set_num_sms gives); CPU tensors are device memory.
#include "emu_host.h"

#include <cstring>

#include "emu_runtime.h"
#include "glue.h"

namespace kvpage {
namespace cuda {

int num_sms() { return emu::num_sms(); }
int compute_capability_major() { return 9; }  // launches that overlap on sm_90 run plainly here
int shared_memory_per_sm() { return 233472; }  // an H100 / H200 SM's 228 KiB

at::Tensor upload_words(const std::vector<int64_t>& words, const at::Device& device) {
  at::Tensor t = at::empty({static_cast<int64_t>(words.size())}, at::TensorOptions().dtype(at::kLong).device(device));
  std::memcpy(t.data_ptr<int64_t>(), words.data(), words.size() * sizeof(int64_t));
  return t;
}

}  // namespace cuda
}  // namespace kvpage
