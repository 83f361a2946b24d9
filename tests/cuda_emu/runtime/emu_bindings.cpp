// Python module of the emulator build: the CUDA backend's five ops (kvpage::cuda::*, the real
// glue and kernels) called with CPU tensors, with the positional signatures of torch.ops.kvpage,
// plus the emulator's controls. ValueError / TypeError from the shared checks keep their type.
#include <torch/extension.h>

#include "emu_runtime.h"
#include "ops.h"

namespace py = pybind11;


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvpage's CUDA kernels run by a CPU emulator (tests only)";
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  m.def("reshape_and_cache", &kvpage::cuda::reshape_and_cache);
  m.def("paged_attention", &kvpage::cuda::paged_attention);
  m.def("paged_prefill_attention", &kvpage::cuda::paged_prefill_attention);
  m.def("copy_blocks", [](std::vector<at::Tensor> k, std::vector<at::Tensor> v, const at::Tensor& mapping,
                          bool check_ranges) { kvpage::cuda::copy_blocks(k, v, mapping, check_ranges); });
  m.def("swap_blocks", [](std::vector<at::Tensor> src, std::vector<at::Tensor> dst, const at::Tensor& mapping,
                          bool check_ranges) { kvpage::cuda::swap_blocks(src, dst, mapping, check_ranges); });
  m.def("probe_overrun", [](const at::Tensor& x, int64_t offset) {
    return emu::probe_overrun(x.data_ptr<float>(), static_cast<int>(offset));
  });
  m.def("probe_missing_barrier", &emu::probe_missing_barrier);
  m.def("probe_divergent_barrier", &emu::probe_divergent_barrier);
  m.def("probe_early_cp_async_read", &emu::probe_early_cp_async_read);
  m.def("probe_smem_without_opt_in", &emu::probe_smem_without_opt_in);
  m.def("probe_fp8_conversion_mismatches", &emu::probe_fp8_conversion_mismatches);
  m.def("probe_ldmatrix_mismatches", &emu::probe_ldmatrix_mismatches);
  m.def("probe_movmatrix_mismatches", &emu::probe_movmatrix_mismatches);
  m.def("set_seed", &emu::set_seed, py::arg("seed"), py::arg("random_order") = true);
  m.def("set_num_sms", &emu::set_num_sms);
  m.def("stats", [] {
    const emu::Stats s = emu::stats();
    return py::dict(py::arg("launches") = s.launches, py::arg("blocks") = s.blocks,
                    py::arg("threads") = s.threads,
                    py::arg("switches") = s.switches, py::arg("barriers") = s.barriers,
                    py::arg("collectives") = s.collectives, py::arg("mmas") = s.mmas);
  });
}
