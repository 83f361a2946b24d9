// [kv tier] The argument checks of the KV tier's pybind11 functions (bound in torch_bindings.cpp): every Python
// buffer held for the length of the call and every argument checked, each error naming it, while the GIL is
// held, so the kernels (cpu/kv_blocks.cpp, cpu/checksum.cpp) get only raw pointers and sizes that fit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

namespace kvpage::kv_tier {

// A Python object's buffer, held for the length of a call.
class HeldBuffer {
 public:
  HeldBuffer(const pybind11::handle& obj, int flags, const std::string& what) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      const bool c_order = (flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS;
      throw pybind11::type_error(what + " must be a " + ((flags & PyBUF_WRITABLE) ? "writable " : "") +
                                 (c_order ? "C-contiguous" : "contiguous") + " bytes-like object, got " +
                                 Py_TYPE(obj.ptr())->tp_name);
    }
  }
  ~HeldBuffer() { PyBuffer_Release(&view_); }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  const Py_buffer& view() const { return view_; }
  uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }

 private:
  Py_buffer view_{};
};

// write_kv_blocks / read_kv_blocks' arguments, checked: the pointers stay valid while `held` lives (destroy it
// with the GIL held: releasing a buffer is a Python call).
struct KVBlockCopyArgs {
  std::vector<std::unique_ptr<HeldBuffer>> held;
  std::vector<uint8_t*> cache_ptrs, payload_ptrs;
  std::vector<int64_t> row_bytes;  // per cache: one block's bytes
};

// The caches' part of KVBlockCopyArgs (write/read_kv_blocks, load_kv_files): each cache held (writable: written),
// every block id inside it; returns a block's bytes over all caches.
inline int64_t hold_caches(KVBlockCopyArgs& args, const pybind11::sequence& caches,
                           const std::vector<int64_t>& block_ids, bool writable) {
  if (caches.size() == 0) throw pybind11::value_error("caches must hold at least one cache buffer");
  const int cache_flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  int64_t block_bytes = 0;
  for (size_t t = 0; t < caches.size(); ++t) {
    const std::string what = "caches[" + std::to_string(t) + "]";
    args.held.push_back(std::make_unique<HeldBuffer>(caches[t], cache_flags, what));
    const Py_buffer& v = args.held.back()->view();
    if (v.ndim < 1 || v.shape[0] < 1) throw pybind11::value_error(what + " must have a first dimension of blocks");
    for (size_t i = 0; i < block_ids.size(); ++i) {
      if (block_ids[i] < 0 || block_ids[i] >= v.shape[0]) {
        throw pybind11::value_error("block_ids[" + std::to_string(i) + "] = " + std::to_string(block_ids[i]) +
                                    " is outside " + what + "'s " + std::to_string(v.shape[0]) + " blocks");
      }
    }
    args.cache_ptrs.push_back(args.held.back()->data());
    args.row_bytes.push_back(v.len / v.shape[0]);
    block_bytes += args.row_bytes.back();
  }
  return block_bytes;
}

// caches: one C-contiguous buffer per cache tensor, its first dimension the blocks (writable when to_cache);
// payloads[i]: block block_ids[i]'s row of every cache in turn (writable when not to_cache).
inline KVBlockCopyArgs check_kv_block_copy_args(const pybind11::sequence& payloads,
                                                const std::vector<int64_t>& block_ids,
                                                const pybind11::sequence& caches, bool to_cache) {
  if (payloads.size() != block_ids.size()) {
    throw pybind11::value_error("payloads and block_ids must have the same length, got " +
                                std::to_string(payloads.size()) + " and " + std::to_string(block_ids.size()));
  }
  KVBlockCopyArgs args;
  const int64_t block_bytes = hold_caches(args, caches, block_ids, to_cache);
  const int payload_flags = PyBUF_SIMPLE | (to_cache ? 0 : PyBUF_WRITABLE);
  for (size_t i = 0; i < payloads.size(); ++i) {
    const std::string what = "payloads[" + std::to_string(i) + "]";
    args.held.push_back(std::make_unique<HeldBuffer>(payloads[i], payload_flags, what));
    if (args.held.back()->view().len != block_bytes) {
      throw pybind11::value_error(what + " has " + std::to_string(args.held.back()->view().len) +
                                  " bytes; a block of these caches takes " + std::to_string(block_bytes));
    }
    args.payload_ptrs.push_back(args.held.back()->data());
  }
  return args;
}

// read_kv_files' arguments, checked: the same lifetime rule as KVBlockCopyArgs.
struct KVFileReadArgs {
  std::vector<std::unique_ptr<HeldBuffer>> held;
  std::vector<uint8_t*> dsts;
  std::vector<int64_t> capacities;  // each buffer's bytes
  std::vector<const char*> paths;   // into the caller's strings
};

inline KVFileReadArgs check_kv_file_read_args(const std::vector<std::string>& paths,
                                              const pybind11::sequence& buffers,
                                              const std::vector<int64_t>& crc_starts) {
  if (buffers.size() != paths.size() || crc_starts.size() != paths.size()) {
    throw pybind11::value_error("paths, buffers and crc_starts must have the same length, got " +
                                std::to_string(paths.size()) + ", " + std::to_string(buffers.size()) + " and " +
                                std::to_string(crc_starts.size()));
  }
  KVFileReadArgs args;
  for (size_t i = 0; i < paths.size(); ++i) {
    args.held.push_back(std::make_unique<HeldBuffer>(buffers[i], PyBUF_SIMPLE | PyBUF_WRITABLE,
                                                     "buffers[" + std::to_string(i) + "]"));
    args.dsts.push_back(args.held.back()->data());
    args.capacities.push_back(args.held.back()->view().len);
    args.paths.push_back(paths[i].c_str());
    if (crc_starts[i] < 0) {
      throw pybind11::value_error("crc_starts[" + std::to_string(i) + "] must be >= 0, got " +
                                  std::to_string(crc_starts[i]));
    }
  }
  return args;
}

// load_kv_files' arguments, checked: the same lifetime rule as KVBlockCopyArgs.
struct KVFileLoadArgs {
  KVBlockCopyArgs caches;
  std::vector<const char*> paths;  // into the caller's strings
};

// File i (sizes[i] bytes) holds block block_ids[i]'s row of every cache (writable) in turn from offsets[i] on.
inline KVFileLoadArgs check_kv_file_load_args(const std::vector<std::string>& paths, const std::vector<int64_t>& sizes,
                                              const std::vector<int64_t>& offsets,
                                              const std::vector<int64_t>& block_ids, const pybind11::sequence& caches) {
  if (sizes.size() != paths.size() || offsets.size() != paths.size() || block_ids.size() != paths.size()) {
    throw pybind11::value_error("paths, sizes, offsets and block_ids must have the same length, got " +
                                std::to_string(paths.size()) + ", " + std::to_string(sizes.size()) + ", " +
                                std::to_string(offsets.size()) + " and " + std::to_string(block_ids.size()));
  }
  KVFileLoadArgs args;
  const int64_t block_bytes = hold_caches(args.caches, caches, block_ids, true);
  for (size_t i = 0; i < paths.size(); ++i) {
    if (offsets[i] < 0 || sizes[i] != offsets[i] + block_bytes) {
      throw pybind11::value_error("sizes[" + std::to_string(i) + "] must be offsets[" + std::to_string(i) +
                                  "] + a block's bytes in these caches (" + std::to_string(block_bytes) +
                                  ") with offsets[" + std::to_string(i) + "] >= 0, got " + std::to_string(sizes[i]) +
                                  " and " + std::to_string(offsets[i]));
    }
    args.paths.push_back(paths[i].c_str());
  }
  return args;
}

}  // namespace kvpage::kv_tier
