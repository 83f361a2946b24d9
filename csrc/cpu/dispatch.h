// Run-time choice of the kernel ISA, and the dynamic work loop every CPU op uses.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace kvpage {
namespace cpu {

// Kernels for the ISA in use: AVX-512, else AVX2+FMA+F16C where the CPU has them, else the portable build;
// KVPAGE_CPU_ISA=generic (or set_isa) forces the fallback.
const KernelTable& active_kernels();
void set_isa(const std::string& name);
std::vector<std::string> available_isas();
// Whether the active kernels run a bf16 query's prefill attention over a bf16 cache on AMX tiles
// (attention_amx.h): the avx512 kernels, on a CPU with AMX-BF16 whose OS grants the tile state.
bool amx_attention_active();
// Whether packed_linear can take pair-interleaved bf16 slabs (bf16 dot products): the avx512 kernels
// are active and the CPU has AVX512-BF16 (linear_ops.cpp).
bool bf16_dot_available();
// packed_linear's out = (input @ W.T + bias) + residual in one pass, residual [m, n] float32 contiguous
// (linear_ops.cpp): a decoder layer's residual adds without a separate elementwise pass.
void packed_linear_add(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, const at::Tensor& residual);

// Runs body(first, last, scratch) over [0, num_items) in runs of consecutive items handed out from a
// shared counter to torch's intra-op threads, so items of very different costs still balance across
// cores, and a thread that starts late (a loaded machine: another process holds its core) finds the
// others have taken its share instead of the whole op waiting for it to do half. One item at a time
// cost ~10% of a decode step (SmolLM2, 64 sequences: 192 items of ~1 us per layer): every grab is a
// locked add on a line the other core just wrote. Runs of num_items / (16 * workers) bound the
// imbalance to ~1/16 of a worker's share.
template <typename Body>
void parallel_runs(int64_t num_items, int64_t scratch_floats, const Body& body) {
  if (num_items <= 0) return;
  struct alignas(64) Counter {  // a cache line of its own: nothing else on it bounces with the counter
    std::atomic<int64_t> next{0};
  } counter;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  const int64_t run = std::max<int64_t>(1, num_items / (16 * workers));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t first = counter.next.fetch_add(run); first < num_items; first = counter.next.fetch_add(run)) {
        body(first, std::min(num_items, first + run), scratch.data());
      }
    }
  });
}

// Runs body(item, scratch) for item in [0, num_items) as parallel_runs hands them out; a body taking a
// third argument also gets the item's RunPosition (decode attention prefetches the next item's
// tiles when the same thread runs it).
template <typename Body>
void parallel_items(int64_t num_items, int64_t scratch_floats, const Body& body) {
  parallel_runs(num_items, scratch_floats, [&](int64_t first, int64_t last, float* scratch) {
    for (int64_t i = first; i < last; ++i) {
      if constexpr (std::is_invocable_v<const Body&, int64_t, float*, RunPosition>) {
        body(i, scratch, RunPosition{i > first, i + 1 < last});
      } else {
        body(i, scratch);
      }
    }
  });
}

}  // namespace cpu
}  // namespace kvpage
