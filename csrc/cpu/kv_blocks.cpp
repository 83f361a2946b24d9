// The KV offload tier's batch work in C++: a load's block files read and checksummed (kv_offload/disk_tier.py), a
// load's block files read into a CPU KV cache's rows and checksummed on the way (load_kv_files: through a small
// per-thread chunk buffer, no whole-payload host copy), and whole KV blocks between host payloads and a CPU KV cache (kv_offload/worker.py). A block's payload
// is its row of every cache tensor, one after another; the tier hands a load's payloads over as separate buffers
// (views of the files it read and verified), and the cache is one tensor per layer and K/V. One call moves a whole
// batch with the GIL released, block by block (a payload is read front to back while its lines are fresh), instead
// of a Python loop of one slice assignment per (block, tensor).
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../ops.h"
#include "stream_store.h"

namespace kvpage {
namespace cpu {
namespace {

// Chunks of at least ~256 KiB per thread: a tiny model's blocks are a few KiB, not worth a thread each.
int64_t grain_for(int64_t item_bytes) {
  return std::max<int64_t>(1, (int64_t{256} << 10) / std::max<int64_t>(item_bytes, 1));
}

// dst <- src, n bytes, with non-temporal stores where the CPU has them (SSE2: every x86-64): a load writes tens
// of MB of cache rows that are not read again before they leave the caches, so reading each destination line
// in first (a plain store's read-for-ownership) is wasted memory traffic.
void store_stream(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) stream_line(dst + i, src + i);
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// path opened for reading if it is a regular file: its descriptor (the caller closes it), st its status; else -1
// with r.error set. O_NONBLOCK: something other than a file under a block's name (a FIFO) cannot hang the step; a
// regular file's reads ignore it.
int open_regular(const char* path, struct stat& st, KVFileRead& r) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    r.error = errno;
    return -1;
  }
  if (::fstat(fd, &st) != 0) {
    r.error = errno;
  } else if (!S_ISREG(st.st_mode)) {
    r.error = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
  }
  if (r.error != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// pread until n bytes are in dst, the file ends or a read fails (r.error set): the bytes read.
int64_t pread_full(int fd, uint8_t* dst, int64_t n, int64_t pos, KVFileRead& r) {
  int64_t got = 0;
  while (got < n) {  // a read may return less: on to the end (or a file that shrank meanwhile)
    const ssize_t m = ::pread(fd, dst + got, static_cast<size_t>(n - got), pos + got);
    if (m < 0 && errno == EINTR) continue;
    if (m < 0) {
      r.error = errno;
      break;
    }
    if (m == 0) break;
    got += m;
  }
  return got;
}

KVFileRead read_one(const char* path, uint8_t* dst, int64_t capacity, int64_t crc_start) {
  KVFileRead r{0, 0, 0};
  struct stat st;
  const int fd = open_regular(path, st, r);
  if (fd < 0) return r;
  if (st.st_size > capacity) {
    r.size = st.st_size;  // not read: the caller reads it on its own
  } else {
    r.size = pread_full(fd, dst, st.st_size, 0, r);
    if (r.error == 0 && r.size >= crc_start) {
      // Right after the read, while the block is in this core's caches.
      r.crc = crc32c(dst + crc_start, static_cast<size_t>(r.size - crc_start), 0);
    }
  }
  ::close(fd);
  return r;
}

// A load reads a file a chunk at a time into this buffer (one per op thread, kept: no fresh pages per load), small
// enough to stay in the core's L2, from where crc32c_copy checksums each chunk while streaming it into the rows. One
// pass over memory-cold rows with non-temporal stores, instead of a read straight into them (the kernel's copy reads
// each cold row line in first) and a second pass to checksum them. Big enough that a block takes few reads.
constexpr int64_t kChunkBytes = int64_t{256} << 10;

uint8_t* chunk_buffer() {
  thread_local std::unique_ptr<uint8_t[]> buffer(new uint8_t[kChunkBytes]);
  return buffer.get();
}

KVFileRead load_one(const char* path, int64_t size, int64_t offset, uint8_t* const* rows, const int64_t* row_bytes,
                    int64_t num_caches) {
  KVFileRead r{0, 0, 0};
  struct stat st;
  const int fd = open_regular(path, st, r);
  if (fd < 0) return r;
  if (st.st_size != size) {
    r.size = st.st_size;  // not the file that was checked: nothing read
    ::close(fd);
    return r;
  }
  uint8_t* chunk = chunk_buffer();
  uint32_t crc = 0;
  int64_t pos = offset, t = 0, in_row = 0;  // the file position, the row (cache) and the place in it it goes to
  while (pos < size) {
    const int64_t want = std::min(kChunkBytes, size - pos);
    const int64_t got = pread_full(fd, chunk, want, pos, r);
    pos += got;
    for (int64_t b = 0; b < got;) {  // the arguments' check: size - offset is the rows' bytes, so t stays in range
      if (in_row == row_bytes[t]) {
        ++t, in_row = 0;
        continue;
      }
      const int64_t n = std::min(got - b, row_bytes[t] - in_row);
      crc = crc32c_copy(rows[t] + in_row, chunk + b, static_cast<size_t>(n), crc);
      b += n, in_row += n;
    }
    if (got < want) break;  // the file ended early (shrank since the fstat) or a read failed
  }
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();  // crc32c_copy's streamed stores are visible before the forward reads the rows
#endif
  r.size = pos;  // the position reached: the caller compares it with the size it checked
  if (r.error == 0 && r.size == size) r.crc = crc;
  ::close(fd);
  return r;
}

}  // namespace

void load_kv_files(const char* const* paths, const int64_t* sizes, const int64_t* offsets, const int64_t* block_ids,
                   int64_t num_files, uint8_t* const* caches, const int64_t* row_bytes, int64_t num_caches,
                   KVFileRead* out) {
  int64_t block_bytes = 0;
  for (int64_t t = 0; t < num_caches; ++t) block_bytes += row_bytes[t];
  at::parallel_for(0, num_files, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t*> rows(static_cast<size_t>(num_caches));
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t t = 0; t < num_caches; ++t) rows[t] = caches[t] + block_ids[i] * row_bytes[t];
      out[i] = load_one(paths[i], sizes[i], offsets[i], rows.data(), row_bytes, num_caches);
    }
  });
}

void read_kv_files(const char* const* paths, uint8_t* const* dsts, const int64_t* capacities,
                   const int64_t* crc_starts, int64_t num_files, KVFileRead* out) {
  int64_t total = 0;
  for (int64_t i = 0; i < num_files; ++i) total += capacities[i];
  at::parallel_for(0, num_files, grain_for(num_files ? total / num_files : 0), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = read_one(paths[i], dsts[i], capacities[i], crc_starts[i]);
  });
}

void copy_kv_blocks(uint8_t* const* payloads, const int64_t* block_ids, int64_t num_blocks, uint8_t* const* caches,
                    const int64_t* row_bytes, int64_t num_caches, bool to_cache) {
  int64_t block_bytes = 0;
  for (int64_t t = 0; t < num_caches; ++t) block_bytes += row_bytes[t];
  at::parallel_for(0, num_blocks, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint8_t* payload = payloads[i];
      for (int64_t t = 0; t < num_caches; ++t) {
        uint8_t* row = caches[t] + block_ids[i] * row_bytes[t];
        if (to_cache) {
          store_stream(row, payload, static_cast<size_t>(row_bytes[t]));
        } else {
          std::memcpy(payload, row, row_bytes[t]);
        }
        payload += row_bytes[t];
      }
    }
#if defined(__x86_64__) || defined(_M_X64)
    if (to_cache) _mm_sfence();  // this thread's streamed stores are visible before the forward reads the rows
#endif
  });
}

}  // namespace cpu
}  // namespace kvpage
