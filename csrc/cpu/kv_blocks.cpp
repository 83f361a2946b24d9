// The KV offload tier's batch work in C++: a load's block files read and checksummed (kv_offload/disk_tier.py), a
// load's block files read straight into a CPU KV cache's rows and checksummed there (load_kv_files: no host copy in
// between), and whole KV blocks between host payloads and a CPU KV cache (kv_offload/worker.py). A block's payload
// is its row of every cache tensor, one after another; the tier hands a load's payloads over as separate buffers
// (views of the files it read and verified), and the cache is one tensor per layer and K/V. One call moves a whole
// batch with the GIL released, block by block (a payload is read front to back while its lines are fresh), instead
// of a Python loop of one slice assignment per (block, tensor).
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../ops.h"

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
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
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

KVFileRead read_one(const char* path, uint8_t* dst, int64_t capacity, int64_t crc_start) {
  KVFileRead r{0, 0, 0};
  struct stat st;
  const int fd = open_regular(path, st, r);
  if (fd < 0) return r;
  if (st.st_size > capacity) {
    r.size = st.st_size;  // not read: the caller reads it on its own
  } else {
    while (r.size < st.st_size) {  // a read may return less: on to the end (or a file that shrank meanwhile)
      const ssize_t n = ::read(fd, dst + r.size, static_cast<size_t>(st.st_size - r.size));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        r.error = errno;
        break;
      }
      if (n == 0) break;
      r.size += n;
    }
    if (r.error == 0 && r.size >= crc_start) {
      // Right after the read, while the block is in this core's caches.
      r.crc = crc32c(dst + crc_start, static_cast<size_t>(r.size - crc_start), 0);
    }
  }
  ::close(fd);
  return r;
}

// preadv until every iovec is full, the file ends or a read fails; returns the file position reached (r.error set
// on a failed read).
int64_t preadv_all(int fd, std::vector<iovec>& iov, int64_t pos, KVFileRead& r) {
  size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::preadv(fd, iov.data() + first, count, pos);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      r.error = errno;
      break;
    }
    if (n == 0) break;  // the file is shorter than it was when checked
    pos += n;
    for (size_t left = static_cast<size_t>(n); left > 0;) {  // a read may fill the iovecs only in part
      if (left >= iov[first].iov_len) {
        left -= iov[first++].iov_len;
      } else {
        iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
        left = 0;
      }
    }
  }
  return pos;
}

KVFileRead load_one(const char* path, int64_t size, int64_t offset, uint8_t* const* rows, const int64_t* row_bytes,
                    int64_t num_caches) {
  KVFileRead r{0, 0, 0};
  struct stat st;
  const int fd = open_regular(path, st, r);
  if (fd < 0) return r;
  if (st.st_size != size) {
    r.size = st.st_size;  // not the file that was checked: nothing read
  } else {
    std::vector<iovec> iov(static_cast<size_t>(num_caches));
    for (int64_t t = 0; t < num_caches; ++t) iov[t] = iovec{rows[t], static_cast<size_t>(row_bytes[t])};
    r.size = preadv_all(fd, iov, offset, r);
    if (r.error == 0 && r.size == size) {
      // Over the rows just written, while they are in this core's caches.
      for (int64_t t = 0; t < num_caches; ++t) r.crc = crc32c(rows[t], static_cast<size_t>(row_bytes[t]), r.crc);
    }
  }
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
