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

std::atomic<const KernelTable*>& current() {
  static std::atomic<const KernelTable*> table{initial_kernels()};
  return table;
}

}  // namespace

const KernelTable& active_kernels() { return *current().load(); }

void set_isa(const std::string& name) {
  const KernelTable* table = by_name(name);
  TORCH_CHECK_VALUE(table != nullptr, "isa '", name, "' is not available on this CPU");
  current().store(table);
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names{"generic"};
  if (cpu_has_avx2()) names.push_back("avx2");
  if (cpu_has_avx512()) names.push_back("avx512");
  return names;
}

}  // namespace cpu
}  // namespace kvpage
