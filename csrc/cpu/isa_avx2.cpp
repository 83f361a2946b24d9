// Kernels built with -mavx2 -mfma -mf16c (see CMakeLists.txt); used only where the CPU has them.
#define KVPAGE_ISA_NS avx2
#define KVPAGE_ISA_NAME "avx2"
#include "attention_impl.h"

namespace kvpage {
namespace cpu {
const KernelTable& avx2_kernels() { return avx2::kernels(); }
}  // namespace cpu
}  // namespace kvpage
