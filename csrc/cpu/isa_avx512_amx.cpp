// The AVX-512 kernels built again with AMX (see CMakeLists.txt): the same table, whose prefill attention
// runs a bf16 query over a bf16 cache on AMX tiles (attention_amx.h). dispatch.cpp uses it in place of
// isa_avx512.cpp's only where the CPU has AMX-BF16 and AVX512-BF16 and the OS grants the tile state.
#define KVPAGE_ISA_NS avx512_amx
#define KVPAGE_ISA_NAME "avx512"
#define KVPAGE_AMX 1
#include "attention_impl.h"

namespace kvpage {
namespace cpu {
const KernelTable& avx512_amx_kernels() { return avx512_amx::kernels(); }
}  // namespace cpu
}  // namespace kvpage
