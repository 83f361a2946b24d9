// The emulator's scheduler (see cuda_emu.h): a launch's blocks spread over an OpenMP team, the
// threads of a block as fibers on one OS thread, barriers, warp-collective arrivals (served in
// emu_collectives.cpp), shared memory and cp.async; the launch itself.
#include "emu_internal.h"

#include <cuda_fp16.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
// AddressSanitizer build (build_emu.load(asan=True)): every stack switch is announced, so ASan
// checks each fiber against its own stack.
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

// switch(save, next): pushes the callee-saved registers, stores the stack pointer in *save, loads
// next and pops the same frame from it. A new fiber's stack is laid out as such a frame whose
// return address is the trampoline, with the fiber in r12. (The SSE / x87 control words are
// callee-saved too, but nothing here changes them, so they are not switched.)
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch

.globl emu_trampoline
.hidden emu_trampoline
.type emu_trampoline,@function
emu_trampoline:
  movq %r12, %rdi
  call emu_fiber_main
  ud2
.size emu_trampoline, .-emu_trampoline
)");

extern "C" void emu_switch(void** save, void* next);
extern "C" void emu_trampoline();

namespace emu {
namespace detail {


// Switches stacks: saves this context's stack pointer in *save_sp and resumes to_sp, whose stack
// is [to_bottom, to_bottom + to_size). fake_stack: this context's ASan slot, nullptr when it will
// never resume.
void switch_context(void** save_sp, void** fake_stack, void* to_sp, const void* to_bottom, size_t to_size) {
#ifdef EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack, to_bottom, to_size);
#else
  (void)fake_stack, (void)to_bottom, (void)to_size;
#endif
  emu_switch(save_sp, to_sp);
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack ? *fake_stack : nullptr, nullptr, nullptr);
#endif
}

void switch_to_fiber(void** save_sp, void** fake_stack, Fiber& to) {
  switch_context(save_sp, fake_stack, to.sp, to.stack, kStackBytes);
}

char* stack_for(int i) {
  Worker& e = W();
  while (static_cast<int>(e.stacks.size()) <= i) {
    // A guard page below each stack turns an overflow into a fault instead of silent damage.
    void* p = mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("emu: cannot map a fiber stack");
    mprotect(p, 4096, PROT_NONE);
    e.stacks.push_back(static_cast<char*>(p) + 4096);
  }
  return e.stacks[i];
}

// The next thread to run, drawn from the runnable ones (or in thread order); nullptr if none.
Fiber* pick_next(Block& b) {
  if (b.runnable.empty()) return nullptr;
  Worker& e = W();
  size_t pick = 0;
  if (E().random_order) {
    e.rng ^= e.rng >> 12, e.rng ^= e.rng << 25, e.rng ^= e.rng >> 27;
    pick = static_cast<size_t>((e.rng * 0x2545F4914F6CDD1Dull) >> 32) % b.runnable.size();
  }
  const int next = b.runnable[pick];
  b.runnable[pick] = b.runnable.back();
  b.runnable.pop_back();
  return &b.fibers[next];
}

// Hands the CPU from the running thread straight to the next runnable one (or back to the
// scheduler when none is left: the block is done, or deadlocked).
void yield(Block& b) {
  Fiber* f = b.running;
  Fiber* next = b.error.empty() ? pick_next(b) : nullptr;
  if (next == f) return;
  ++W().stats.switches;
  void** fake = f->state == State::kDone ? nullptr : &f->fake_stack;  // a finished thread never resumes
  if (next == nullptr) {
    switch_context(&f->sp, fake, b.scheduler_sp, b.scheduler_bottom, b.scheduler_size);
  } else {
    b.running = next;
    switch_to_fiber(&f->sp, fake, *next);
  }
}

void fail(Block& b, const std::string& message) {
  if (b.error.empty()) b.error = message;
  Fiber* f = b.running;
  f->state = State::kDone;
  for (;;) switch_context(&f->sp, nullptr, b.scheduler_sp, b.scheduler_bottom, b.scheduler_size);
}

std::string thread_name(const Fiber& f) {
  std::ostringstream s;
  const uint3& bi = W().block_idx;
  s << "thread (" << f.tid.x << "," << f.tid.y << "," << f.tid.z << ") of block (" << bi.x << "," << bi.y << ","
    << bi.z << ")";
  return s.str();
}

void make_runnable(Block& b, Fiber& f) {
  f.state = State::kRunnable;
  b.runnable.push_back(f.linear);
}

// ---- block execution -----------------------------------------------------------------------

void check_exit(Block& b, Fiber& f) {
  if (b.at_barrier > 0) {
    b.error = thread_name(f) + " exited while " + std::to_string(b.at_barrier) +
              " threads wait at __syncthreads (a barrier not every thread reaches)";
  }
  const int warp = f.linear / 32;
  b.warps[warp].exited |= 1u << lane_of(f);
  if (b.warps[warp].arrived > 0 && (b.warps[warp].mask >> lane_of(f) & 1)) {
    b.error = thread_name(f) + " exited while its warp waits for it in a collective";
  }
}

std::string deadlock_report(const Block& b) {
  std::ostringstream s;
  s << "deadlock: no thread can run (" << b.at_barrier << " at __syncthreads, " << b.done << " exited";
  for (size_t w = 0; w < b.warps.size(); ++w) {
    if (b.warps[w].arrived) s << ", warp " << w << ": " << b.warps[w].arrived << " lanes in a collective";
  }
  s << ")";
  return s.str();
}

void run_block(int num_threads) {
  Worker& e = W();
  const dim3 dims = E().block;
  Block b;
  e.current = &b;
  b.fibers.resize(num_threads);
  b.warps.resize((num_threads + 31) / 32);
  ++e.block_serial;
  e.dynamic_smem.assign(E().smem, 0xFF);  // each block starts poisoned
  for (int i = 0; i < num_threads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.tid = make_uint3(i % dims.x, i / dims.x % dims.y, i / (dims.x * dims.y));
    f.stack = stack_for(i);
#ifdef EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);  // frames of abandoned or finished threads
#endif
    // Initial frame for emu_switch: r15..r12 (r12 = the fiber), rbx, rbp, then the return
    // address = trampoline, placed so the trampoline's call sees the ABI's 16-byte alignment.
    auto* frame = reinterpret_cast<uint64_t*>(f.stack + kStackBytes - 128 + 8);
    frame[0] = frame[1] = frame[2] = 0;                   // r15, r14, r13
    frame[3] = reinterpret_cast<uint64_t>(&f);            // r12
    frame[4] = frame[5] = 0;                              // rbx, rbp
    frame[6] = reinterpret_cast<uint64_t>(&emu_trampoline);
    f.sp = frame;
    b.runnable.push_back(i);
  }
  // Threads hand over to each other (yield); control comes back here only when none can run.
  while (b.done < num_threads && b.error.empty()) {
    b.running = pick_next(b);
    if (b.running == nullptr) {
      b.error = deadlock_report(b);
      break;
    }
    switch_to_fiber(&b.scheduler_sp, &b.scheduler_fake_stack, *b.running);
  }
  e.current = nullptr;
  if (!b.error.empty()) throw std::runtime_error(b.error);
}

Block& block() {
  Block* b = W().current;
  if (b == nullptr) throw std::logic_error("emu: device code called outside a kernel launch");
  return *b;
}

}  // namespace detail

using namespace detail;

// ---- the API of cuda_emu.h -------------------------------------------------------------------

const uint3& thread_idx() { return block().running->tid; }
const uint3& block_idx() { return W().block_idx; }
const dim3& block_dim() { return E().block; }
const dim3& grid_dim() { return E().grid; }

void sync_block() {
  Block& b = block();
  Fiber& f = *b.running;
  if (b.done > 0) fail(b, thread_name(f) + " reached __syncthreads after another thread of its block exited");
  f.state = State::kAtBarrier;
  ++W().stats.barriers;
  if (++b.at_barrier == static_cast<int>(b.fibers.size())) {
    b.at_barrier = 0;
    for (Fiber& o : b.fibers) make_runnable(b, o);
  }
  yield(b);
}

void warp_collective(Op op, unsigned mask, void* request, int* int_result) {
  Block& b = block();
  Fiber& f = *b.running;
  const int warp = f.linear / 32, lane = lane_of(f);
  const int warp_size = std::min(32, static_cast<int>(b.fibers.size()) - warp * 32);
  const unsigned existing = warp_size == 32 ? 0xffffffffu : (1u << warp_size) - 1;
  if (!(mask >> lane & 1)) fail(b, thread_name(f) + " is not in its own collective's mask");
  if (mask & ~existing) fail(b, thread_name(f) + ": collective mask names lanes the block does not have");
  const bool needs_full_warp = op == Op::kMmaF16 || op == Op::kMmaBF16 || op == Op::kLdmatrixX4 ||
                               op == Op::kLdmatrixX4Trans || op == Op::kMovmatrixTrans;
  if (needs_full_warp && mask != 0xffffffffu) {
    fail(b, thread_name(f) + ": mma / ldmatrix / movmatrix need the whole warp");
  }
  WarpState& w = b.warps[warp];
  if (w.arrived == 0) {
    w.op = op, w.mask = mask;
  } else if (w.op != op || w.mask != mask) {
    fail(b, thread_name(f) + " meets its warp at a different collective (divergent warp-synchronous code)");
  }
  if (mask & w.exited) {
    fail(b, thread_name(f) + " waits in a collective for lane " + std::to_string(__builtin_ctz(mask & w.exited)) +
                ", which has exited");
  }
  f.state = State::kInCollective;
  f.op = op, f.mask = mask, f.request = request, f.int_result = int_result;
  ++W().stats.collectives;
  if (++w.arrived == __builtin_popcount(mask)) serve_warp(b, warp);
  yield(b);
}

void* dynamic_smem() { return W().dynamic_smem.data(); }

void shared_decl(void* address, size_t bytes) {
  Worker& e = W();
  uint64_t& serial = e.shared_serial[address];
  if (serial != e.block_serial) {
    std::memset(address, 0xFF, bytes);
    serial = e.block_serial;
  }
}

void cp_async16(void* smem, const void* gmem, bool valid) {
  block().running->current.push_back({smem, gmem, valid});
}

void cp_async_commit() {
  Fiber& f = *block().running;
  f.committed.push_back(std::move(f.current));
  f.current.clear();
}

void cp_async_wait(int newest_pending) {
  Fiber& f = *block().running;
  const int land = static_cast<int>(f.committed.size()) - newest_pending;
  for (int g = 0; g < land; ++g) {
    for (const Copy& c : f.committed[g]) {
      if (c.valid) std::memcpy(c.dst, c.src, 16); else std::memset(c.dst, 0, 16);
    }
  }
  if (land > 0) f.committed.erase(f.committed.begin(), f.committed.begin() + land);
}

namespace {

// splitmix64 of (seed, launch, block): a block's thread order depends on nothing else.
uint64_t block_seed(uint64_t launch, uint64_t block) {
  uint64_t z = E().seed * 0x9E3779B97F4A7C15ull + launch * 0xD1B54A32D192ED03ull + block * 0x8CB92BA72F3D8DD7ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z ? z : 1;  // never 0: xorshift's fixed point
}

void add_stats(Stats& total, const Stats& part) {
  total.blocks += part.blocks, total.threads += part.threads, total.switches += part.switches, total.barriers += part.barriers;
  total.collectives += part.collectives, total.mmas += part.mmas;
}

}  // namespace

void run_grid(const void* kernel, dim3 grid, dim3 block_dims, size_t smem, KernelBody body, void* closure) {
  Emulator& e = E();
  std::lock_guard<std::mutex> lock(e.launch_mutex);
  const uint64_t threads = uint64_t(block_dims.x) * block_dims.y * block_dims.z;
  const auto limit = e.smem_limits.count(kernel) ? e.smem_limits[kernel] : kDefaultSmem;
  std::string bad;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    bad = "grid";
  } else if (threads == 0 || threads > kMaxThreads || block_dims.z > 64) {
    bad = "block";
  } else if (smem > limit) {
    bad = "dynamic shared memory (" + std::to_string(smem) + " bytes, limit " + std::to_string(limit) + ")";
  }
  if (!bad.empty()) {
    if (e.last_error == cudaSuccess) {
      e.last_error = cudaErrorInvalidConfiguration;
      e.last_message = "emu: invalid launch configuration: " + bad;
    }
    return;
  }
  e.grid = grid, e.block = block_dims, e.smem = smem, e.body = body, e.closure = closure;
  ++e.stats.launches;
  const uint64_t launch = ++e.launch_serial;
  const int64_t num_blocks = int64_t(grid.x) * grid.y * grid.z;
  // A GPU promises no order among blocks, so any OS thread may run any block; a block's thread
  // order comes from (seed, launch, block), whichever runs it. After a failure no new block
  // starts, and the lowest failing block's message is the launch's.
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  int64_t first_failure = std::numeric_limits<int64_t>::max();
  std::string message;
#pragma omp parallel if (num_blocks > 1)
  {
    Worker& w = W();
    w.stats = Stats{};
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < num_blocks; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      w.block_idx = make_uint3(unsigned(i % grid.x), unsigned(i / grid.x % grid.y), unsigned(i / (int64_t(grid.x) * grid.y)));
      w.rng = block_seed(launch, uint64_t(i));
      ++w.stats.blocks, w.stats.threads += uint64_t(threads);
      try {
        run_block(static_cast<int>(threads));
      } catch (const std::exception& ex) {
        std::lock_guard<std::mutex> guard(error_mutex);
        if (i < first_failure) first_failure = i, message = ex.what();
        failed = true;
      }
    }
#pragma omp critical(emu_stats)
    add_stats(e.stats, w.stats);
  }
  if (failed && e.last_error == cudaSuccess) {
    e.last_error = cudaErrorLaunchFailure;
    e.last_message = "emu: kernel failed: " + message;
  }
}

void set_seed(uint64_t seed, bool random_order) {
  E().seed = seed;
  E().random_order = random_order;
}
void set_num_sms(int n) { E().num_sms = n; }
int num_sms() { return E().num_sms; }
Stats stats() { return E().stats; }

}  // namespace emu

// The fiber's first frame: run the kernel body, then hand back to the scheduler for good.
extern "C" __attribute__((visibility("hidden"), used)) void emu_fiber_main(emu::detail::Fiber* f) {
  using namespace emu::detail;
  const Emulator& e = E();
  Block& b = *W().current;
#ifdef EMU_ASAN
  // The first thread of a block starts from the scheduler's stack: remember its bounds.
  const void* from_bottom = nullptr;
  size_t from_size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &from_bottom, &from_size);
  if (b.scheduler_size == 0) b.scheduler_bottom = from_bottom, b.scheduler_size = from_size;
#endif
  e.body(e.closure);
  f->state = State::kDone;
  ++b.done;
  check_exit(b, *f);
  yield(b);  // never resumed: a finished thread is not runnable
  for (;;) switch_context(&f->sp, nullptr, b.scheduler_sp, b.scheduler_bottom, b.scheduler_size);
}
