// The emulator's controls, for the bindings (emu_bindings.cpp) and the op glue (emu_glue.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "emu_api.h"

namespace emu {

struct Stats {
  uint64_t launches = 0, blocks = 0, switches = 0, barriers = 0, collectives = 0;
};

// seed: the order in which runnable threads are picked; random_order=false runs them in
// thread order (deterministic, as lock-step as cooperative scheduling gets).
void set_seed(uint64_t seed, bool random_order);
// What cudaDevAttrMultiProcessorCount reports (the decode planner's single-pass vs split choice).
void set_num_sms(int n);
int num_sms();
Stats stats();

}  // namespace emu
