// The emulator's interface between device code and its scheduler (emu_runtime.cpp): thread
// indices, barriers, warp collectives, cp.async, kernel launch. Included by cuda_emu.h (kernel
// sources) and emu_runtime.h (host side); free of macros, so it is safe beside torch's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

namespace emu {

// ---- the scheduler's side (emu_runtime.cpp) --------------------------------------------------
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void sync_block();
// Dynamic shared memory of the running block (0xFF-filled at its start).
void* dynamic_smem();
// A static __shared__ variable: filled with 0xFF by the first thread of each block to reach it.
void shared_decl(void* address, size_t bytes);

// Warp collectives: every lane of the warp in `mask` arrives with a request; the last arrival
// serves them all (emu_collectives.cpp).
enum class Op : int { kShuffle, kBallot, kSyncWarp, kMmaF16, kMmaBF16, kLdmatrixX4, kLdmatrixX4Trans, kMovmatrixTrans };
struct ShuffleRequest {
  uint64_t value;  // the lane's var, bit-copied (up to 8 bytes)
  int mode;        // 0 idx, 1 up, 2 down, 3 xor
  int arg;         // src lane, delta or lane mask
  int width;
  uint64_t result;
};
struct MmaRequest {
  float* d;  // 4 accumulators, in/out
  uint32_t a[4], b[2];
};
struct LdmatrixRequest {
  const void* row;  // this lane's row address
  uint32_t* r;      // 4 results
};
void warp_collective(Op op, unsigned mask, void* request, int* int_result);

// cp.async: queued per thread, copied at the wait_group that covers its group.
void cp_async16(void* smem, const void* gmem, bool valid);
void cp_async_commit();
void cp_async_wait(int newest_pending);

// ---- kernel launch ---------------------------------------------------------------------------
using KernelBody = void (*)(void* closure);
// Runs body(closure) once per thread of every block; records a launch error (bad dims, too
// much dynamic shared memory for `kernel`) for cudaGetLastError instead of running.
void run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem, KernelBody body, void* closure);

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  template <typename... A>
  void operator()(A&&... args) const {
    // Kernel parameters are copied once, like a launch's parameter buffer; each thread then
    // receives its own by-value copy.
    struct Closure {
      void (*kernel)(P...);
      std::tuple<std::decay_t<P>...> args;
    } closure{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    run_grid(reinterpret_cast<const void*>(kernel), grid, block, smem,
             [](void* c) {
               auto* cl = static_cast<Closure*>(c);
               std::apply(cl->kernel, cl->args);
             },
             &closure);
  }
};

template <typename... P>
Launch<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return Launch<P...>{kernel, grid, block, smem};
}

inline void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1, bool bf16) {
  MmaRequest r{d, {a[0], a[1], a[2], a[3]}, {b0, b1}};
  warp_collective(bf16 ? Op::kMmaBF16 : Op::kMmaF16, 0xffffffffu, &r, nullptr);
}
inline void ldmatrix_x4(uint32_t* result, const void* row) {
  LdmatrixRequest r{row, result};
  warp_collective(Op::kLdmatrixX4, 0xffffffffu, &r, nullptr);
}
inline void ldmatrix_x4_trans(uint32_t* result, const void* row) {
  LdmatrixRequest r{row, result};
  warp_collective(Op::kLdmatrixX4Trans, 0xffffffffu, &r, nullptr);
}

// movmatrix.sync.m8n8.trans.b16, served like a shuffle: each lane's fragment word in, its
// transposed word out.
inline uint32_t movmatrix_trans(uint32_t x) {
  ShuffleRequest r{x, 0, 0, 32, 0};
  warp_collective(Op::kMovmatrixTrans, 0xffffffffu, &r, nullptr);
  return static_cast<uint32_t>(r.result);
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
template <typename T>
T shuffle(unsigned mask, T var, int mode, int arg, int width) {
  ShuffleRequest r{to_bits(var), mode, arg, width, 0};
  warp_collective(Op::kShuffle, mask, &r, nullptr);
  return from_bits<T>(r.result);
}

}  // namespace emu
