#include "dispatch.h"

#include <c10/util/Exception.h>
#include <cstdlib>
#if defined(KVPAGE_HAVE_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

#if defined(KVPAGE_HAVE_AMX)
// AMX-BF16 tiles (and AVX512-BF16, which the AMX build's bf16 conversions use), enabled by the OS in XCR0
// and granted to this process: Linux hands the tile data state (XTILEDATA, 18) only to a process that
// asks (ARCH_REQ_XCOMP_PERM), once; a kernel that refuses keeps the plain avx512 kernels.
bool cpu_has_amx() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    if (!cpu_has_avx512() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx = (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
    if (!amx || !__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax >> 5 & 1)) return false;  // AVX512-BF16
    unsigned xcr0_lo, xcr0_hi;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo >> 17 & 3) != 3) return false;  // XTILECFG and XTILEDATA
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return usable;
}
#endif

const KernelTable* avx512_table() {
#if defined(KVPAGE_HAVE_AMX)
  if (cpu_has_amx()) return &avx512_amx_kernels();
#endif
#if defined(KVPAGE_HAVE_AVX512)
  return &avx512_kernels();
#else
  return nullptr;
#endif
}

const KernelTable* by_name(const std::string& name) {
  if (name == "generic") return &generic_kernels();
#if defined(KVPAGE_HAVE_AVX2)
  if (name == "avx2" && cpu_has_avx2()) return &avx2_kernels();
#endif
#if defined(KVPAGE_HAVE_AVX512)
  if (name == "avx512" && cpu_has_avx512()) return avx512_table();
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

bool amx_attention_active() {
#if defined(KVPAGE_HAVE_AMX)
  return &active_kernels() == &avx512_amx_kernels();
#else
  return false;
#endif
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names{"generic"};
  if (cpu_has_avx2()) names.push_back("avx2");
  if (cpu_has_avx512()) names.push_back("avx512");
  return names;
}

}  // namespace cpu
}  // namespace kvpage
