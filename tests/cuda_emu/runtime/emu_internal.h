// The emulator's state, shared by its scheduler (emu_runtime.cpp), the warp collectives
// (emu_collectives.cpp) and the CUDA runtime calls (emu_cuda_api.cpp). Not for kernel code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emu_runtime.h"

namespace emu {
namespace detail {

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kMaxThreads = 1024;
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr size_t kMaxSmemOptIn = 227 * 1024;  // H100 / H200: 227 KiB per block

struct Copy {
  void* dst;
  const void* src;
  bool valid;
};

enum class State { kRunnable, kAtBarrier, kInCollective, kDone };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  uint3 tid{};
  int linear = 0;
  State state = State::kRunnable;
  // the pending collective
  Op op{};
  unsigned mask = 0;
  void* request = nullptr;
  int* int_result = nullptr;
  void* fake_stack = nullptr;  // ASan's bookkeeping while switched out
  // cp.async groups
  std::vector<std::vector<Copy>> committed;
  std::vector<Copy> current;
};

struct WarpState {
  int arrived = 0;
  Op op{};
  unsigned mask = 0;
  unsigned exited = 0;  // lanes that have finished the kernel
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<int> runnable;
  int at_barrier = 0, done = 0;
  void* scheduler_sp = nullptr;
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_bottom = nullptr;  // the scheduler's stack (ASan builds)
  size_t scheduler_size = 0;
  Fiber* running = nullptr;
  std::string error;  // set: abandon the block
};

// Process-wide: configuration, the sticky error, and the running launch (read-only while its
// blocks run).
struct Emulator {
  std::mutex launch_mutex;
  uint64_t seed = 0;
  bool random_order = true;
  int num_sms = 132;
  cudaError_t last_error = cudaSuccess;
  std::string last_message;
  std::map<const void*, size_t> smem_limits;
  uint64_t launch_serial = 0;
  Stats stats;
  // the running launch
  dim3 grid{}, block{};
  size_t smem = 0;
  KernelBody body = nullptr;
  void* closure = nullptr;
};

inline Emulator& E() {
  static Emulator e;
  return e;
}

// One per OS thread that runs blocks (a launch spreads its blocks over an OpenMP team): the
// block it runs, whose fibers never leave this thread, and everything that block may touch.
// `__shared__` statics are thread_local for the same reason.
struct Worker {
  Block* current = nullptr;
  uint3 block_idx{};
  uint64_t rng = 0;  // xorshift64* state, seeded per block
  std::vector<char*> stacks;
  std::vector<unsigned char> dynamic_smem;
  std::map<void*, uint64_t> shared_serial;
  uint64_t block_serial = 0;
  Stats stats;  // this launch's counts, merged into E().stats when the launch ends
};

inline Worker& W() {
  static thread_local Worker w;
  return w;
}

[[noreturn]] void fail(Block& b, const std::string& message);
std::string thread_name(const Fiber& f);
void make_runnable(Block& b, Fiber& f);
inline int lane_of(const Fiber& f) { return f.linear % 32; }
// Serves the collective every lane of `warp` has arrived at (emu_collectives.cpp).
void serve_warp(Block& b, int warp);

}  // namespace detail
}  // namespace emu
