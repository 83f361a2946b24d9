// The emulator's controls, for the bindings (emu_bindings.cpp) and the op glue (emu_glue.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "emu_api.h"

namespace emu {

struct Stats {
  uint64_t launches = 0, blocks = 0, threads = 0, switches = 0, barriers = 0, collectives = 0;
  uint64_t mmas = 0;  // warp-wide mma.sync operations served (tensor-core paths)
};

// seed: the order in which runnable threads are picked; random_order=false runs them in
// thread order (deterministic, as lock-step as cooperative scheduling gets).
void set_seed(uint64_t seed, bool random_order);
// What cudaDevAttrMultiProcessorCount reports (the decode planner's single-pass vs split choice).
void set_num_sms(int n);
int num_sms();
Stats stats();

// Planted bugs the emulator must expose (emu_probes.cpp); each returns what it observed.
float probe_overrun(const float* x, int offset);  // reads x[i + offset], i < 32
int probe_missing_barrier();                       // threads that read before the write
std::string probe_divergent_barrier();             // the launch's error message
int probe_early_cp_async_read();                   // threads that saw their copy early
std::string probe_smem_without_opt_in();           // the launch's error message
int probe_fp8_conversion_mismatches();              // sm_80 fp8 path vs CUDA's conversion, non-NaN pairs
int probe_movmatrix_mismatches();                  // movmatrix.trans words off the PTX layout; -1: error
int probe_ldmatrix_mismatches();                   // ldmatrix(.trans) registers off the PTX layout; -1: error

}  // namespace emu
