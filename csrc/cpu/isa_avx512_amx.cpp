// The avx512 kernel table with AMX prefill attention (see CMakeLists.txt): attention_impl.h built again with
// AMX, of which the table takes only what a bf16 query over a bf16 cache runs (prefill items on AMX tiles,
// attention_amx.h, and their scratch); every other op and dtype keeps isa_avx512.cpp's own kernels, the same
// code as on a CPU without AMX. dispatch.cpp uses it in place of avx512_kernels() only where the CPU has
// AMX-BF16 and AVX512-BF16 and the OS grants the tile state.
#define KVPAGE_ISA_NS avx512_amx
#define KVPAGE_ISA_NAME "avx512"
#define KVPAGE_AMX 1
#include "attention_impl.h"

namespace kvpage {
namespace cpu {
namespace {

// This build's scratch: isa_avx512.cpp's, plus the AMX operand tiles for bf16 arguments.
int64_t amx_scratch_floats(const AttentionArgs& a, int64_t rows) {
  return avx512_amx::kernels().scratch_floats(a, rows);
}

void amx_prefill_item(const AttentionArgs& a, const PrefillPlan& p, int64_t tile, int64_t kv_head, float* scratch) {
  if (!avx512_amx::amx_dtypes(a)) return avx512_kernels().prefill_item(a, p, tile, kv_head, scratch);
  avx512_amx::kernels().prefill_item(a, p, tile, kv_head, scratch);
}

}  // namespace

const KernelTable& avx512_amx_kernels() {
  static const KernelTable table = [] {
    KernelTable t = avx512_kernels();
    t.scratch_floats = amx_scratch_floats;
    t.prefill_item = amx_prefill_item;
    return t;
  }();
  return table;
}

}  // namespace cpu
}  // namespace kvpage
