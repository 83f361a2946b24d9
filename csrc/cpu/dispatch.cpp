#include "dispatch.h"

#include <c10/util/Exception.h>
#include <cstdlib>

namespace kvpage {
namespace cpu {
namespace {

bool cpu_has_avx2() {
#if defined(KVPAGE_HAVE_AVX2)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(KVPAGE_HAVE_AVX512)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const KernelTable* by_name(const std::string& name) {
  if (name == "generic") return &generic_kernels();
#if defined(KVPAGE_HAVE_AVX2)
  if (name == "avx2" && cpu_has_avx2()) return &avx2_kernels();
#endif
#if defined(KVPAGE_HAVE_AVX512)
  if (name == "avx512" && cpu_has_avx512()) return &avx512_kernels();
#endif
  return nullptr;
}

const KernelTable* initial_kernels() {
  if (const char* env = std::getenv("KVPAGE_CPU_ISA")) {
    const KernelTable* forced = by_name(env);
    TORCH_CHECK_VALUE(forced != nullptr, "KVPAGE_CPU_ISA=", env, " is not available on this CPU");
    return forced;
  }
  if (cpu_has_avx512()) return by_name("avx512");
  return cpu_has_avx2() ? by_name("avx2") : &generic_kernels();
}

// Chosen at first use, not at load: a bad KVPAGE_CPU_ISA then raises in that op (and in every op
// until set_isa picks one), instead of failing a static initialiser that set_isa could not undo.
std::atomic<const KernelTable*> current{nullptr};

}  // namespace

const KernelTable& active_kernels() {
  const KernelTable* table = current.load();
  if (table == nullptr) {
    const KernelTable* expected = nullptr;
    current.compare_exchange_strong(expected, initial_kernels());  // a racing set_isa wins
    table = current.load();
  }
  return *table;
}

void set_isa(const std::string& name) {
  const KernelTable* table = by_name(name);
  TORCH_CHECK_VALUE(table != nullptr, "isa '", name, "' is not available on this CPU");
  current.store(table);
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names{"generic"};
  if (cpu_has_avx2()) names.push_back("avx2");
  if (cpu_has_avx512()) names.push_back("avx512");
  return names;
}

}  // namespace cpu
}  // namespace kvpage
