// Run-time choice of the kernel ISA, and the dynamic work loop every CPU op uses.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <string>
#include <vector>

#include "kernels.h"

namespace kvpage {
namespace cpu {

// Kernels for the ISA in use: AVX-512, else AVX2+FMA+F16C where the CPU has them, else the portable build;
// KVPAGE_CPU_ISA=generic (or set_isa) forces the fallback.
const KernelTable& active_kernels();
void set_isa(const std::string& name);
std::vector<std::string> available_isas();

// Runs body(item, scratch) for item in [0, num_items) on torch's intra-op threads. Items are
// handed out one at a time, so sequences of very different lengths still balance across cores.
template <typename Body>
void parallel_items(int64_t num_items, int64_t scratch_floats, const Body& body) {
  if (num_items <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) body(i, scratch.data());
    }
  });
}

}  // namespace cpu
}  // namespace kvpage
