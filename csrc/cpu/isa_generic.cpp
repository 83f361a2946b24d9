// Kernels built for the compiler's baseline target: the portable fallback for any CPU.
#define KVPAGE_ISA_NS generic
#define KVPAGE_ISA_NAME "generic"
#include "attention_impl.h"

namespace kvpage {
namespace cpu {
const KernelTable& generic_kernels() { return generic::kernels(); }
}  // namespace cpu
}  // namespace kvpage
