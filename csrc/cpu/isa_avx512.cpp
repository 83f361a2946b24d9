// Kernels built with AVX-512 (see CMakeLists.txt); used only where the CPU has it. The row kernels
// are the AVX2 ones compiled again (AVX-512 includes AVX2); attention runs its 4-row blocks at 16
// lanes (microkernels.h) and the packed linear layer of gemm_impl.h gets its 16-lane kernel.
#define KVPAGE_ISA_NS avx512
#define KVPAGE_ISA_NAME "avx512"
#include "attention_impl.h"

namespace kvpage {
namespace cpu {
const KernelTable& avx512_kernels() { return avx512::kernels(); }
}  // namespace cpu
}  // namespace kvpage
