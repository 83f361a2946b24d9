"""The disk tier behind a CPU pool's prefix cache (kv_offload.tiers has what all tiers share). Its batch reads
and checksums are the compiled extension's kvpage._C.read_kv_files and crc32c.

The disk tier keeps one file per block, under a directory named by the model fingerprint (the model,
weights, dtypes, block size, tokenizer and kvpage version: worker.model_fingerprint), so another model's
files are never even looked at. A file is written to a temporary name, fsynced and renamed into place:
a reader (this process or another sharing the directory) sees a whole block or none, and a crash
leaves at most a temporary file, which is ignored (and removed once stale). There is no separate
index to get out of step with the data: the files are the index (read at start-up, so a new process
starts warm). Every read checks the header (magic, format version, fingerprint, block hash, full key),
the length and a checksum of the payload; a file failing any check is skipped with one warning and
removed, never loaded. The scheduler's lookup (match_many) checks all but the checksum from a small read; the
payload is then read straight into the pool's rows after allocation (load_into, behind a CPU pool) and its
checksum checked there: a payload failing then is a load error, and its tokens are recomputed (KVLoadError).
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import struct
import threading
import time
from functools import cache
from pathlib import Path

import numpy as np

from kvpage.core.hashing import HASH_SIZE, group_key
from kvpage.core.prefix_cache import BlockKey

from .read_buffers import ReadBuffers
from .tiers import _Tier, _until_miss

logger = logging.getLogger("kvpage")

# 16 bytes; the last byte is the file format's version: 2, CRC-32C payload checksums (1, zlib's CRC-32, is
# skipped like any other foreign file: the block is recomputed and written again).
MAGIC = b"KVPAGE-KVBLOCK\x00\x02"
# fingerprint, block hash, parent hash, payload checksum (16 bytes each), the KV-cache group (2 bytes little-endian,
# zero-padded to 16: zero, group 0, in files written before hybrid layouts were offloaded); token bytes, extra keys,
# payload lengths.
_HEADER = struct.Struct(f"<16s{HASH_SIZE}s{HASH_SIZE}s{HASH_SIZE}s16sIIQ")
SUFFIX = ".kvb"
# A temporary file this old is a crashed writer's, not one being written.
STALE_TMP_SECONDS = 600.0
# Blocks waiting for the disk writer; past this a store is dropped (counted), never waited for.
WRITE_QUEUE_BLOCKS = 256


@cache
def _extension():
    """kvpage._C (its crc32c and read_kv_files), imported on first use."""
    import torch  # noqa: F401  (the extension needs libtorch loaded)
    from kvpage import _C
    return _C


def _checksum(payload) -> bytes:
    # CRC-32C (in a 16-byte field): it catches flipped bits and torn writes, and on SSE4.2's crc32 instruction
    # (kvpage._C.crc32c) it costs a load ~6x less than zlib's CRC-32; a cryptographic hash would cost a load
    # more than the prefill it saves. The key, not this, names the block.
    return _checksum_field(_extension().crc32c(payload))


def _checksum_field(crc: int) -> bytes:
    return crc.to_bytes(4, "little") + bytes(12)


def _payload_start(key: BlockKey) -> int:
    """Where the payload starts in the file of the block keyed `key` (the header's lengths are the key's)."""
    return len(MAGIC) + _HEADER.size + len(key.token_bytes) + len(_extra_bytes(key))


def _extra_bytes(key: BlockKey) -> bytes:
    # The same repr hashing.hash_block commits to (stable for the types Sequence allows).
    return repr(key.extra_keys).encode() if key.extra_keys else b""


def _group_bytes(key: BlockKey) -> bytes:
    return key.group.to_bytes(2, "little") + bytes(14)


def _write_file(path: str, chunks) -> None:
    """Write and fsync one file (the disk tier's only write; tests replace it to simulate a full disk)."""
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


class DiskTier(_Tier):
    """Blocks in files under directory/<fingerprint>/ (see the module docstring), at most capacity_bytes
    of them (this process's view: the least recently used files are removed past it). Writes happen on a
    background thread fed by a bounded queue, so a step never waits for the disk; reads are synchronous
    (the step needs the bytes) and verified."""

    name = "disk"

    def __init__(self, directory, fingerprint: str, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(fingerprint, str) or len(fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 hex digits, got {fingerprint!r}")
        self.fingerprint = fingerprint
        self._fingerprint_bytes = bytes.fromhex(fingerprint)
        self.directory = Path(directory).expanduser() / fingerprint
        self._directory_str = str(self.directory)
        _check_writable(self.directory, directory)
        self._warned_write = False
        self._read_buffers = ReadBuffers()
        self.closed = False  # after close(): stores are dropped, nothing waits for the writer
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kvpage-disk-tier", daemon=True)
        self._writer.start()

    # -- the index -----------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return Path(self._file(block_hash))

    def _file(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return f"{self._directory_str}/{name[:2]}/{name}{SUFFIX}"

    def _scan(self) -> None:
        """Index the files already there (a restart starts warm), oldest first; remove stale temporaries."""
        found = []
        now = time.time()
        for sub in self.directory.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    st = path.stat()
                except OSError:
                    continue
                # A group > 0's name is its chain hash tagged with the group (hashing.group_key).
                if path.suffix == SUFFIX and len(path.stem) in (2 * HASH_SIZE, 2 * HASH_SIZE + 4):
                    try:
                        found.append((st.st_mtime, bytes.fromhex(path.stem), st.st_size))
                    except ValueError:
                        continue
                elif path.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                    _unlink(path)  # a writer that crashed before its rename
        for _, block_hash, size in sorted(found):
            self._index.add(block_hash, size)

    def contains(self, block_hash: bytes) -> bool:
        if block_hash in self._index:
            return True
        # Another process sharing the directory may have written it since the scan: one stat.
        try:
            size = self._path(block_hash).stat().st_size
        except OSError:
            return False
        self._index.add(block_hash, size, replace=False)
        return True

    def _forget(self, block_hash: bytes, remove_file: bool) -> None:
        self._index.discard(block_hash)
        if remove_file:
            _unlink(self._path(block_hash))

    # -- reads ---------------------------------------------------------------------------------

    def get(self, block_hash: bytes, key: BlockKey) -> bytes | None:
        """The block's payload, verified against key; None on a miss or a file that fails a check."""
        if not self.contains(block_hash):
            return None
        try:
            data = _read_file(self._path(block_hash))
        except OSError as e:
            return self._check_read(block_hash, key, e.errno or -1, None)
        return self._check_read(block_hash, key, 0, memoryview(data))

    def get_many(self, requests: list[tuple[bytes, BlockKey]]) -> list:
        """As _Tier.get_many: the files the index holds up to the first miss read in one kvpage._C call (in
        parallel on the op threads, each checksummed right after its read, GIL released) into one buffer
        (ReadBuffers: memory faulted in by an earlier load, not fresh pages per block), then checked in order.
        The payloads are views of that buffer."""
        held = []
        for block_hash, key in requests:
            if not self.contains(block_hash):
                break
            held.append((block_hash, key))
        sizes = [self._index.size(block_hash) or 0 for block_hash, _ in held]
        buffer = self._read_buffers.take(sum(sizes))
        views = [buffer.take(size) for size in sizes]
        buffer.release()
        reads = _extension().read_kv_files([self._file(block_hash) for block_hash, _ in held], views,
                                           [_payload_start(key) for _, key in held])
        out = []
        for (block_hash, key), view, (error, size, crc) in zip(held, views, reads):
            if error == 0 and size > len(view):  # the file changed size since it was indexed: read it alone
                out.append(self.get(block_hash, key))
            else:
                out.append(self._check_read(block_hash, key, error, view[:size], crc))
            if out[-1] is None:
                return out
        return out + [None] if len(held) < len(requests) else out

    def _check_read(self, block_hash: bytes, key: BlockKey, error: int, data: memoryview | None,
                    crc: int | None = None) -> memoryview | None:
        """The payload of a file read (error: its errno, 0 if none; data: its bytes; crc: CRC-32C of them from
        _payload_start(key) on, where computed with the read) if it passes every check; else None (a file
        failing one is rejected)."""
        if error:
            return self._read_failed(block_hash, error)
        problem, payload = self._parse(data, block_hash, key, crc)
        if self._accept(block_hash, problem):
            self._count_read(payload)
            return payload
        return None

    def _read_failed(self, block_hash: bytes, error: int) -> None:
        if error == errno.ENOENT:  # removed by another process (its own LRU)
            self._forget(block_hash, remove_file=False)
        else:
            self._reject(block_hash, f"unreadable ({os.strerror(error) if error > 0 else 'read failed'})")

    def _accept(self, block_hash: bytes, problem: str | None) -> bool:
        """Whether a file whose checks found `problem` (None: none) is used (then it is the most recently used);
        a failing file is rejected, but for a true hash collision (another block's file: kept)."""
        if problem is not None:
            if problem != "other key":
                self._reject(block_hash, problem)
            return False
        self.touch(block_hash)
        return True

    # -- loads straight into a CPU cache ---------------------------------------------------------

    def match_many(self, requests: list[tuple[bytes, BlockKey]]) -> list:
        """As get_many, but each hit is a DiskBlock: its file's header and full key checked now (a small read),
        its payload read and checksummed only when loaded (load_into: straight into the cache's rows, after
        allocation). A payload failing its checksum then is a load error (its tokens are recomputed)."""
        return _until_miss(requests, self._match)

    def _match(self, block_hash: bytes, key: BlockKey) -> "DiskBlock | None":
        if not self.contains(block_hash):
            return None
        path = self._file(block_hash)
        try:
            # O_NONBLOCK: something other than a file under a block's name (a FIFO) cannot hang the step.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return self._read_failed(block_hash, errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL)
                head = os.pread(fd, _payload_start(key), 0)
            finally:
                os.close(fd)
        except OSError as e:
            return self._read_failed(block_hash, e.errno or -1)
        problem, checksum, offset = self._parse_header(memoryview(head), st.st_size, block_hash, key)
        if not self._accept(block_hash, problem):
            return None
        return DiskBlock(block_hash, key, path, st.st_size, offset, checksum)

    def load_into(self, blocks: list["DiskBlock"], block_ids: list[int], caches: list) -> list[bool]:
        """Read each block's payload straight into its cache block's rows (kvpage._C.load_kv_files: caches are
        the worker's per-tensor byte views, blocks first) and checksum them; whether each passed. A block that
        fails (gone, changed since matched, corrupt, or not this cache's block size) is rejected as a read
        would reject it, its rows left partly written: the caller must not use them."""
        row_bytes = sum(c.nbytes // c.shape[0] for c in caches)
        ok = [len(b) == row_bytes for b in blocks]
        for b, good in zip(blocks, ok):
            if not good:
                self._reject(b.block_hash, f"a {len(b)}-byte payload; this cache's blocks take {row_bytes}")
        todo = [i for i, good in enumerate(ok) if good]
        results = _extension().load_kv_files([blocks[i].path for i in todo], [blocks[i].size for i in todo],
                                             [blocks[i].offset for i in todo], [block_ids[i] for i in todo], caches)
        for i, (error, size, crc) in zip(todo, results):
            b = blocks[i]
            if error:
                self._read_failed(b.block_hash, error)
            elif size != b.size:
                self._reject(b.block_hash, f"changed since it was matched ({size} bytes, {b.size} then)")
            elif _checksum_field(crc) != b.checksum:
                self._reject(b.block_hash, "corrupt (payload checksum mismatch)")
            else:
                self._count_read(b)
                continue
            ok[i] = False
        return ok

    def read(self, block: "DiskBlock") -> memoryview | None:
        """A matched block's payload read whole and verified now (a load into a cache that is not CPU memory)."""
        return self.get(block.block_hash, block.key)

    def _parse(self, data: memoryview, block_hash: bytes, key: BlockKey,
               crc: int | None = None) -> tuple[str | None, memoryview | None]:
        """(None, payload: a view of data, not a copy) for a whole, matching file; else (what is wrong, None).
        crc: the CRC-32C of data from _payload_start(key) on, where the caller computed it with the read."""
        problem, checksum, offset = self._parse_header(data, len(data), block_hash, key)
        if problem is not None:
            return problem, None
        payload = data[offset:]
        computed = _checksum(payload) if crc is None or offset != _payload_start(key) else _checksum_field(crc)
        if computed != checksum:
            return "corrupt (payload checksum mismatch)", None
        return None, payload

    def _parse_header(self, head: memoryview, file_size: int, block_hash: bytes,
                      key: BlockKey) -> tuple[str | None, bytes | None, int]:
        """The checks of a file of file_size bytes that need only its start `head` (at least up to
        _payload_start(key)): (None, the payload's checksum field, where the payload starts) for a file of this
        model naming this block under `key`, whole by its header's lengths; else (what is wrong, None, 0)."""
        if file_size < len(MAGIC) + _HEADER.size or len(head) < len(MAGIC) + _HEADER.size:
            return "truncated (shorter than its header)", None, 0
        if bytes(head[:len(MAGIC)]) != MAGIC:
            return "not a kvpage block file of this format version", None, 0
        fp, stored_hash, parent, checksum, group, n_tokens, n_extra, n_payload = _HEADER.unpack_from(head, len(MAGIC))
        if fp != self._fingerprint_bytes:
            return "written for another model or configuration (fingerprint differs)", None, 0
        start = len(MAGIC) + _HEADER.size
        if file_size != start + n_tokens + n_extra + n_payload:
            return (f"truncated or padded ({file_size} bytes, header says {start + n_tokens + n_extra + n_payload})",
                    None, 0)
        if group_key(stored_hash, int.from_bytes(group[:2], "little")) != block_hash:
            return "holds another block hash than its name", None, 0
        extra = _extra_bytes(key)
        if (n_tokens != len(key.token_bytes) or n_extra != len(extra) or parent != key.parent_hash
                or bytes(head[start:start + n_tokens]) != key.token_bytes
                or bytes(head[start + n_tokens:start + n_tokens + n_extra]) != extra or group != _group_bytes(key)):
            return "other key", None, 0
        return None, checksum, start + n_tokens + n_extra

    def _reject(self, block_hash: bytes, problem: str) -> None:
        logger.warning("kvpage: KV offload disk tier: skipping %s: %s; it is not loaded (the block is recomputed)",
                       self._file(block_hash), problem)
        self.stats.rejected_blocks += 1
        self._forget(block_hash, remove_file=True)

    # -- writes --------------------------------------------------------------------------------

    def put(self, block_hash: bytes, key: BlockKey, payload) -> None:
        """Queue the block for the writer thread; dropped (counted) when the queue is full."""
        if self.closed:
            self.stats.dropped_blocks += 1
            return
        try:
            self._queue.put_nowait((block_hash, key, payload))
        except queue.Full:
            self.stats.dropped_blocks += 1

    def flush(self) -> None:
        """Wait until every queued block is written (or given up)."""
        if not self.closed:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self.closed:
            return
        self.closed = True
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # never let the thread die: the next block may succeed
                self._warn_write(e)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, key: BlockKey, payload) -> None:
        if block_hash in self._index:
            return
        path = self._path(block_hash)
        extra = _extra_bytes(key)
        header = MAGIC + _HEADER.pack(self._fingerprint_bytes, block_hash, key.parent_hash, _checksum(payload),
                                      _group_bytes(key), len(key.token_bytes), len(extra), len(payload))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            _write_file(tmp, (header, key.token_bytes, extra, payload))
            os.replace(tmp, path)  # atomic: readers see the old state or the whole block
        except OSError as e:
            _unlink(Path(tmp))
            self.stats.dropped_blocks += 1
            self._warn_write(e)
            return
        size = len(header) + len(key.token_bytes) + len(extra) + len(payload)
        self._index.add(block_hash, size, replace=False)
        self._count_stored(payload)
        self._evict_over_capacity()

    def _on_evicted(self, block_hash: bytes, value) -> None:
        _unlink(self._path(block_hash))

    def _warn_write(self, error: Exception) -> None:
        if not self._warned_write:  # once: a full disk would otherwise warn on every block
            self._warned_write = True
            logger.warning("kvpage: KV offload disk tier: writing a block under %s failed (%s); blocks that cannot be"
                           " written are not offloaded (they are recomputed when needed)", self.directory, error)


class DiskBlock:
    """A disk tier hit whose file's header and full key were checked at match time (DiskTier.match_many); its
    payload is read and checksummed when loaded (DiskTier.load_into). len(): the payload's bytes."""

    __slots__ = ("block_hash", "key", "path", "size", "offset", "checksum")

    def __init__(self, block_hash: bytes, key: BlockKey, path: str, size: int, offset: int, checksum: bytes) -> None:
        self.block_hash, self.key, self.path = block_hash, key, path
        self.size, self.offset, self.checksum = size, offset, checksum  # the file's bytes, the payload's start

    def __len__(self) -> int:
        return self.size - self.offset


def _read_file(path: Path) -> bytes:
    """The file's bytes, in reads of its size plus one byte (so a file that grew meanwhile reads as longer than
    its header says): Path.read_bytes grows its buffer as it reads, several times slower for a block."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        chunks, remaining = [], os.fstat(fd).st_size + 1
        while remaining > 0 and (chunk := os.read(fd, remaining)):  # a read may return less: on to the end
            chunks.append(chunk)
            remaining -= len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _check_writable(directory: Path, given) -> None:
    """Create the directory and write a probe file, or raise ValueError naming kv_offloading_dir."""
    probe = directory / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_file(str(probe), (b"",))
        probe.unlink()
    except OSError as e:
        raise ValueError(f"kv_offloading_dir={str(given)!r} is not a writable directory: {e}") from None
