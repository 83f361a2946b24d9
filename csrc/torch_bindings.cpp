// torch.ops.kvpage.*: schemas once, CPU (and CUDA) kernels registered by dispatch key, plus a
// small pybind11 module for things that are not ops.
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "kv_tier_args.h"
#include "ops.h"

TORCH_LIBRARY(kvpage, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, bool check_ranges=True, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int partition_size=0, "
      "bool check_ranges=True, float k_scale=1.0, float v_scale=1.0, Tensor(b!)? lse=None, "
      "int? sliding_window=None, float? softcap=None, Tensor? sinks=None) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
      "bool check_ranges=True, float k_scale=1.0, float v_scale=1.0, Tensor(b!)? lse=None, "
      "int? sliding_window=None, float? softcap=None, Tensor? sinks=None) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping, "
      "bool check_ranges=True) -> ()");
  m.def("swap_blocks(Tensor[] src, Tensor(a!)[] dst, Tensor block_mapping, bool check_ranges=True) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.def("greedy_sample(Tensor(a!) tokens, Tensor(b!) logprobs, Tensor logits) -> ()");
  m.def("rotary_embedding(Tensor(a!) query_out, Tensor(b!) key_out, Tensor query, Tensor key, Tensor cos, "
        "Tensor sin) -> ()");
  m.def("pack_linear_weight(Tensor(a!) packed, Tensor weight) -> ()");
  m.def("packed_linear(Tensor(a!) out, Tensor input, Tensor packed, Tensor? bias) -> ()");
  m.def("llama_decoder_layer(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] widths, float[] epsilons, "
        "float scale, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int max_query_len, "
        "bool check_ranges=True, int? sliding_window=None, float? softcap=None, Tensor? sinks=None) -> Tensor");
}

#define KVPAGE_REGISTER_BACKEND(ns)                                  \
  m.impl("reshape_and_cache", &kvpage::ns::reshape_and_cache);       \
  m.impl("paged_attention", &kvpage::ns::paged_attention);           \
  m.impl("paged_prefill_attention", &kvpage::ns::paged_prefill_attention); \
  m.impl("copy_blocks", &kvpage::ns::copy_blocks);                   \
  m.impl("swap_blocks", &kvpage::ns::swap_blocks);

TORCH_LIBRARY_IMPL(kvpage, CPU, m) {
  KVPAGE_REGISTER_BACKEND(cpu)
  m.impl("rms_norm", &kvpage::cpu::rms_norm);
  m.impl("silu_and_mul", &kvpage::cpu::silu_and_mul);
  m.impl("greedy_sample", &kvpage::cpu::greedy_sample);
  m.impl("rotary_embedding", &kvpage::cpu::rotary_embedding);
  m.impl("pack_linear_weight", &kvpage::cpu::pack_linear_weight);
  m.impl("packed_linear", &kvpage::cpu::packed_linear);
  m.impl("llama_decoder_layer", &kvpage::cpu::llama_decoder_layer);
}

#ifdef KVPAGE_WITH_CUDA
TORCH_LIBRARY_IMPL(kvpage, CUDA, m) { KVPAGE_REGISTER_BACKEND(cuda) }
#endif

namespace {

// [kv tier] kvpage._C.write_kv_blocks / read_kv_blocks: every argument checked (kv_tier_args.h), then one
// copy_kv_blocks call with the GIL released (and taken back before `args` releases the buffers).
void copy_kv_blocks_py(const pybind11::sequence& payloads, const std::vector<int64_t>& block_ids,
                       const pybind11::sequence& caches, bool to_cache) {
  const auto args = kvpage::kv_tier::check_kv_block_copy_args(payloads, block_ids, caches, to_cache);
  pybind11::gil_scoped_release released;
  kvpage::cpu::copy_kv_blocks(args.payload_ptrs.data(), block_ids.data(), static_cast<int64_t>(block_ids.size()),
                              args.cache_ptrs.data(), args.row_bytes.data(),
                              static_cast<int64_t>(args.row_bytes.size()), to_cache);
}

// [kv tier] read_kv_files / load_kv_files' results as Python takes them: (errno, size, crc) per file.
std::vector<std::tuple<int, int64_t, uint32_t>> kv_file_results(const std::vector<kvpage::cpu::KVFileRead>& reads) {
  std::vector<std::tuple<int, int64_t, uint32_t>> out;
  out.reserve(reads.size());
  for (const auto& r : reads) out.emplace_back(r.error, r.size, r.crc);
  return out;
}

// [kv tier] kvpage._C.read_kv_files: (errno, size, crc) of each file read into its buffer, GIL released.
std::vector<std::tuple<int, int64_t, uint32_t>> read_kv_files_py(const std::vector<std::string>& paths,
                                                                 const pybind11::sequence& buffers,
                                                                 const std::vector<int64_t>& crc_starts) {
  const auto args = kvpage::kv_tier::check_kv_file_read_args(paths, buffers, crc_starts);
  std::vector<kvpage::cpu::KVFileRead> reads(paths.size());
  {
    pybind11::gil_scoped_release released;
    kvpage::cpu::read_kv_files(args.paths.data(), args.dsts.data(), args.capacities.data(), crc_starts.data(),
                               static_cast<int64_t>(paths.size()), reads.data());
  }
  return kv_file_results(reads);
}

// [kv tier] kvpage._C.load_kv_files: (errno, size, crc) of each file read into its block's cache rows, GIL released.
std::vector<std::tuple<int, int64_t, uint32_t>> load_kv_files_py(const std::vector<std::string>& paths,
                                                                 const std::vector<int64_t>& sizes,
                                                                 const std::vector<int64_t>& offsets,
                                                                 const std::vector<int64_t>& block_ids,
                                                                 const pybind11::sequence& caches) {
  const auto args = kvpage::kv_tier::check_kv_file_load_args(paths, sizes, offsets, block_ids, caches);
  std::vector<kvpage::cpu::KVFileRead> reads(paths.size());
  {
    pybind11::gil_scoped_release released;
    kvpage::cpu::load_kv_files(args.paths.data(), sizes.data(), offsets.data(), block_ids.data(),
                               static_cast<int64_t>(paths.size()), args.caches.cache_ptrs.data(),
                               args.caches.row_bytes.data(), static_cast<int64_t>(args.caches.row_bytes.size()),
                               reads.data());
  }
  return kv_file_results(reads);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvpage kernels; the ops live in torch.ops.kvpage";
  m.def("cpu_isa", [] { return std::string(kvpage::cpu::active_kernels().isa); },
        "Instruction set the CPU kernels run with");
  m.def("set_cpu_isa", &kvpage::cpu::set_isa, "Force the CPU kernel ISA ('avx512', 'avx2' or 'generic')");
  m.def("available_cpu_isas", &kvpage::cpu::available_isas);
  m.def("amx_attention_active", &kvpage::cpu::amx_attention_active,
        "Whether a bf16 query's prefill attention over a bf16 cache runs on AMX tiles (the avx512 kernels here)");
  m.def("bf16_dot_available", &kvpage::cpu::bf16_dot_available,
        "Whether packed_linear takes pair-interleaved bf16 slabs (AVX512-BF16 dot products) here");
  m.attr("linear_slab_columns") = kvpage::cpu::kSlabColumns;
  // [kv tier] The disk tier's payload checksum, on any contiguous bytes-like object; the GIL is released
  // while it runs (the tier's writer thread checksums beside the engine's steps).
  m.def(
      "crc32c",
      [](const pybind11::object& data, uint32_t crc) {
        const kvpage::kv_tier::HeldBuffer held(data, PyBUF_SIMPLE, "crc32c: data");
        pybind11::gil_scoped_release released;
        return kvpage::cpu::crc32c(held.data(), static_cast<size_t>(held.view().len), crc);
      },
      pybind11::arg("data"), pybind11::arg("crc") = 0,
      "CRC-32C (Castagnoli) of data, continuing from crc: crc32c(b, crc32c(a)) == crc32c(a + b)");
  m.def("read_kv_files", &read_kv_files_py, pybind11::arg("paths"), pybind11::arg("buffers"),
        pybind11::arg("crc_starts"),
        "[kv tier] Read each file whole into its writable buffer (where its size fits; the files in parallel, GIL "
        "released): a list of (errno or 0, the file's size, CRC-32C of its bytes from crc_starts[i] on)");
  m.def("load_kv_files", &load_kv_files_py, pybind11::arg("paths"), pybind11::arg("sizes"), pybind11::arg("offsets"),
        pybind11::arg("block_ids"), pybind11::arg("caches"),
        "[kv tier] Read file i (of sizes[i] bytes; else nothing is read) from offsets[i] on straight into block "
        "block_ids[i]'s row of every cache in turn (files in parallel, GIL released): a list of (errno or 0, the "
        "file's size or the position its read reached, CRC-32C of the rows)");
  for (const auto& [name, to_cache, doc] :
       {std::tuple{"write_kv_blocks", true,
                   "[kv tier] Copy payloads[i] (block block_ids[i]'s row of every cache in turn) into the caches "
                   "(C-contiguous buffers, blocks first), all in one call with the GIL released"},
        std::tuple{"read_kv_blocks", false,
                   "[kv tier] Fill the writable payloads[i] with block block_ids[i]'s row of every cache in turn"}}) {
    m.def(
        name,
        [to_cache = to_cache](const pybind11::sequence& payloads, const std::vector<int64_t>& block_ids,
                              const pybind11::sequence& caches) {
          copy_kv_blocks_py(payloads, block_ids, caches, to_cache);
        },
        pybind11::arg("payloads"), pybind11::arg("block_ids"), pybind11::arg("caches"), doc);
  }
  m.def("crc32c_uses_hardware", &kvpage::cpu::crc32c_uses_hardware,
        "Whether crc32c runs on SSE4.2's crc32 instruction (else the portable loop) with the current ISA");
  m.def("range_checks_run", &kvpage::range_checks_run,
        "How many range checks (the checks that read index data) the ops have run in this process");
  // Whether CMake compiled the AMX translation unit (isa_avx512_amx.cpp: the compiler took -mamx-tile
  // -mamx-bf16 -mavx512bf16): without it amx_attention_active is false on any CPU.
#ifdef KVPAGE_HAVE_AMX
  m.attr("built_with_amx") = true;
#else
  m.attr("built_with_amx") = false;
#endif
#ifdef KVPAGE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
