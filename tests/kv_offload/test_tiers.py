"""The host-memory and disk tiers on their own: exact bytes back, LRU, restart, and every fault case
(truncated, flipped, foreign, unwritable, disk full, crashed writer, two processes' worth of tiers sharing a
directory): a clear warning or error, and never a payload that is not exactly what was written for that key."""
import errno
import logging
import os
import time

import numpy as np
import pytest

from kvpage.core import Sequence
from kvpage.kv_offload import disk_tier, tiers
from kvpage.kv_offload.connector import block_hash, block_key
from kvpage.kv_offload.disk_tier import DiskTier
from kvpage.kv_offload.tiers import HostMemoryTier

FP = "0123456789abcdef" * 2
OTHER_FP = "fedcba9876543210" * 2
BS = 4


def entries(n, extra_keys=(), seed=0):
    """n chained blocks of one sequence: (hash, key, payload) with a payload unique to the block."""
    seq = Sequence(0, [(seed * 131 + i * 7) % 50 + 1 for i in range(n * BS + 1)], extra_keys)
    out = []
    for i in range(n):
        key = block_key(seq, i, BS)
        out.append((block_hash(seq, i, BS), key, bytes([(i + seed) % 256]) * 100 + key.token_bytes))
    return out


def disk(tmp_path, fp=FP, capacity=1 << 20):
    tier = DiskTier(tmp_path, fp, capacity)
    return tier


def store(tier, items):
    for h, k, p in items:
        tier.put(h, k, p)
    tier.flush()


def test_lru_index_both_tiers_share():
    index = tiers.LRUIndex()
    for name, size in ((b"a", 3), (b"b", 4), (b"c", 5)):
        index.add(name, size, name.upper())
    assert index.use(b"a") == b"A" and index.use(b"zz") is None  # "a" is now the most recently used
    assert not index.add(b"b", 40, b"?", replace=False) and index.bytes == 12  # kept, touched: "c" is the oldest
    assert index.pop_lru_over(12) is None  # within capacity: nothing
    assert index.pop_lru_over(12, incoming=1) == (b"c", b"C") and index.bytes == 7
    index.add(b"a", 10, b"A2")  # replaced: its old size no longer counts
    assert index.bytes == 14 and len(index) == 2 and b"c" not in index
    index.discard(b"a")
    index.discard(b"a")
    assert index.bytes == 4 and [h for h, _ in index.items()] == [b"b"]


def test_host_tier_returns_exact_bytes_and_evicts_lru():
    items = entries(4)
    size = len(items[0][2])
    tier = HostMemoryTier(3 * size)
    for h, k, p in items[:3]:
        tier.put(h, k, p)
    assert tier.get(items[0][0], items[0][1]) == items[0][2]  # touches block 0: block 1 is now the oldest
    tier.put(*items[3])
    assert not tier.contains(items[1][0]) and tier.contains(items[0][0]) and len(tier) == 3
    assert tier.used_bytes == 3 * size and tier.stats.evicted_blocks == 1
    # A key that differs from the stored one (a hash collision) gets nothing.
    assert tier.get(items[0][0], items[2][1]) is None


def test_disk_tier_round_trip_and_restart_is_warm(tmp_path):
    items = entries(5)
    tier = disk(tmp_path)
    store(tier, items)
    assert all(tier.get(h, k) == p for h, k, p in items)
    tier.close()
    again = disk(tmp_path)  # a new process: the files are the index
    assert len(again) == 5 and all(again.get(h, k) == p for h, k, p in items)
    # Another model (fingerprint) sharing the directory sees none of it.
    assert len(disk(tmp_path, OTHER_FP)) == 0


def test_disk_tier_lru_capacity(tmp_path):
    items = entries(6)
    tier = disk(tmp_path)
    store(tier, items[:1])
    per_file = tier.used_bytes
    tier.close()
    tier = DiskTier(tmp_path, FP, 3 * per_file)
    store(tier, items[1:])
    assert len(tier) == 3 and tier.used_bytes <= 3 * per_file
    assert [tier.get(h, k) for h, k, _ in items[3:]] == [p for _, _, p in items[3:]]
    assert sum(1 for _ in (tmp_path / FP).rglob("*.kvb")) == 3


def test_extra_keys_are_part_of_the_key(tmp_path):
    (h, k, p), = entries(1, extra_keys=("cache_salt", "a"))
    tier = disk(tmp_path)
    store(tier, [(h, k, p)])
    assert tier.get(h, k) == p
    assert tier.get(h, k._replace(extra_keys=("cache_salt", "b"))) is None


def _file(tier, h):
    return tier._path(h)


def match_and_load(tier, h, k, block_id=1):
    """The disk tier's load straight into a cache (match_many: header and key; load_into: the payload into its
    block's rows, checksummed): the block's row as loaded, None where matching or loading failed."""
    block = tier.match_many([(h, k)])[0]
    if block is None:
        return None
    cache = np.zeros((3, len(block)), dtype=np.uint8)
    return bytes(cache[block_id]) if tier.load_into([block], [block_id], [cache]) == [True] else None


@pytest.mark.parametrize("read", ["get", "get_many", "match_and_load"])
@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "pad", "empty", "foreign",
                                    "older_format"])
def test_damaged_file_is_skipped_with_one_warning(tmp_path, caplog, damage, read):
    """Through get, get_many (kvpage._C.read_kv_files' reads and checksums; a file longer than indexed is read on
    its own) and match_and_load (a flipped payload passes the match and fails its load)."""
    items = entries(2)
    tier = disk(tmp_path)
    store(tier, items)
    h, k, p = items[1]
    path = _file(tier, h)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-7]
    elif damage == "flip_payload":
        data[-3] ^= 0x40
    elif damage == "flip_header":
        data[3] ^= 0x01
    elif damage == "pad":
        data += b"\0"
    elif damage == "empty":
        data = b""
    elif damage == "older_format":  # format version 1 (zlib's CRC-32), as an earlier kvpage wrote it
        data[len(disk_tier.MAGIC) - 1] = 1
    else:  # a file another model's tier wrote, under this model's name
        other = DiskTier(tmp_path, OTHER_FP, 1 << 20)
        store(other, [items[1]])
        data = _file(other, h).read_bytes()
    path.write_bytes(bytes(data))
    get = {"get": tier.get, "get_many": lambda h, k: tier.get_many([(h, k)])[0],
           "match_and_load": lambda h, k: match_and_load(tier, h, k)}[read]
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        assert get(h, k) is None
        assert get(h, k) is None  # asked again: no second warning, the file is gone
    warnings = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert not path.exists() and tier.stats.rejected_blocks == 1
    assert tier.get(*items[0][:2]) == items[0][2]  # the intact block still loads
    assert match_and_load(tier, *items[0][:2]) == items[0][2]


def test_a_block_changed_after_its_match_fails_its_load(tmp_path, caplog):
    """What load_into reads is checked again: a file removed since the match (another process's LRU) is a quiet
    miss; one whose payload bytes changed, or that another of its size replaced, fails its checksum (one
    warning, the file removed); one whose payload length is not the cache's is rejected unread. The blocks
    that passed hold exactly their payloads."""
    items = entries(5)
    tier = disk(tmp_path)
    store(tier, items)
    blocks = tier.match_many([(h, k) for h, k, _ in items])
    assert all(b is not None and len(b) == len(p) for b, (_, _, p) in zip(blocks, items))
    _file(tier, items[1][0]).unlink()
    path = _file(tier, items[3][0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    cache = np.zeros((6, len(items[0][2])), dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        ok = tier.load_into(blocks, [5, 4, 3, 2, 1], [cache])
        assert tier.load_into(blocks[:1], [0], [np.zeros((1, 7), dtype=np.uint8)]) == [False]
    assert ok == [True, False, True, False, True]
    assert [bytes(cache[b]) for b in (5, 3, 1)] == [items[i][2] for i in (0, 2, 4)]
    warnings = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warnings) == 2 and "checksum" in warnings[0] and "cache's blocks take 7" in warnings[1]
    assert not tier.contains(items[1][0]) and not path.exists() and tier.stats.rejected_blocks == 2


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_offloading_dir=.*not a writable directory"):
        DiskTier(blocker / "tier", FP, 1 << 20)


def test_disk_full_warns_once_and_stores_nothing(tmp_path, monkeypatch, caplog):
    real = disk_tier._write_file

    def full_disk(path, chunks):
        with open(path, "wb") as f:  # half a block reaches the disk, then the write fails
            f.write(b"".join(chunks)[:50])
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = disk(tmp_path)
    monkeypatch.setattr(disk_tier, "_write_file", full_disk)
    items = entries(3)
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        store(tier, items)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "No space left" in caplog.records[0].getMessage() and len(caplog.records) == 1
    assert len(tier) == 0 and tier.stats.dropped_blocks == 3
    assert not list((tmp_path / FP).rglob("*.tmp")) and not list((tmp_path / FP).rglob("*.kvb"))
    assert all(tier.get(h, k) is None for h, k, _ in items)
    monkeypatch.setattr(disk_tier, "_write_file", real)  # space again: stores work
    store(tier, items)
    assert all(tier.get(h, k) == p for h, k, p in items)


def test_a_stalled_disk_never_blocks_a_store(tmp_path, monkeypatch):
    """Stores are queued for the writer thread: with the disk stalled, put() returns at once, and past the
    queue's bound blocks are dropped (counted), never waited for; once the disk moves, the queued ones land."""
    import threading

    real, writing, stalled = disk_tier._write_file, threading.Event(), threading.Event()

    def stalled_disk(path, chunks):
        writing.set()
        stalled.wait()
        real(path, chunks)

    monkeypatch.setattr(disk_tier, "WRITE_QUEUE_BLOCKS", 2)
    tier = disk(tmp_path)
    monkeypatch.setattr(disk_tier, "_write_file", stalled_disk)
    items = entries(6)
    try:
        tier.put(*items[0])
        assert writing.wait(60)  # the writer holds the first block, stalled
        for h, k, p in items[1:]:  # two queue behind it, three are dropped: no put waited
            tier.put(h, k, p)
        assert tier.stats.dropped_blocks == 3 and len(tier) == 0
    finally:
        stalled.set()
    tier.flush()
    assert len(tier) == 3 and all(tier.get(h, k) == p for h, k, p in items[:3])
    tier.close()


def test_crash_before_rename_leaves_nothing_loadable(tmp_path):
    """A writer killed between writing the data and renaming it into place (the file is the index entry)
    leaves a temporary file: never indexed, never read; removed at start-up once stale."""
    items = entries(2)
    tier = disk(tmp_path)
    store(tier, items[:1])
    h, k, p = items[1]
    final = _file(tier, h)
    final.parent.mkdir(exist_ok=True)
    tmp = final.parent / (final.name + ".999.1.tmp")
    tmp.write_bytes(_file(tier, items[0][0]).read_bytes()[:40])
    fresh = final.parent / (final.name + ".999.2.tmp")
    fresh.write_bytes(b"being written")
    old = time.time() - 2 * disk_tier.STALE_TMP_SECONDS
    os.utime(tmp, (old, old))
    again = disk(tmp_path)
    assert again.get(h, k) is None and len(again) == 1
    assert not tmp.exists() and fresh.exists()  # a recent one may be another process's write in progress


def test_two_tiers_sharing_a_directory(tmp_path):
    """Two processes' tiers on one directory: each sees the other's whole blocks (a write lands by
    rename), writing the same block twice is harmless, and one removing a file is a miss for the other."""
    items = entries(4)
    a, b = disk(tmp_path), disk(tmp_path)
    store(a, items[:2])
    assert b.get(*items[0][:2]) == items[0][2]  # b never indexed it: found by name
    store(b, items[1:])
    store(a, items[1:])
    assert all(a.get(h, k) == p and b.get(h, k) == p for h, k, p in items)
    _file(a, items[3][0]).unlink()
    assert b.get(*items[3][:2]) is None and not b.contains(items[3][0])


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_get_many_reads_up_to_the_first_miss(tmp_path, caplog, kind):
    """get_many is get() of each block in order, stopping after the first miss: exact bytes before it,
    nothing read past it; on disk a damaged file mid-batch is that miss (one warning), and a block another
    process wrote since the scan (not in this tier's index, so not in the batch's buffer) still loads."""
    items = entries(5)
    tier = HostMemoryTier(1 << 20) if kind == "host" else disk(tmp_path)
    store(tier, items[:4])
    requests = [(h, k) for h, k, _ in items]
    assert tier.get_many(requests[:4]) == [p for _, _, p in items[:4]]
    assert tier.get_many(requests) == [p for _, _, p in items[:4]] + [None]
    if kind == "host":
        return
    reads = tier.stats.read_blocks
    path = _file(tier, items[1][0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        assert tier.get_many(requests) == [items[0][2], None]
    assert tier.stats.read_blocks == reads + 1  # blocks 2 and 3 were not read
    assert len([r for r in caplog.records if "skipping" in r.getMessage()]) == 1
    other = disk(tmp_path)
    store(other, items[4:])
    assert not tier._index.size(items[4][0])
    assert tier.get_many(requests[2:]) == [p for _, _, p in items[2:]]


def _address(payload) -> int:
    return np.frombuffer(payload, dtype=np.uint8).__array_interface__["data"][0]


def test_get_many_payloads_outlive_later_loads(tmp_path):
    """get_many's payloads are views of a read buffer the tier reuses: never while one of its payloads is
    held (they keep their exact bytes through later loads), and once none is (the next load reads into it)."""
    items = entries(6)
    tier = disk(tmp_path)
    store(tier, items)
    requests = [(h, k) for h, k, _ in items]
    held = tier.get_many(requests[:3])
    for _ in range(3):
        later = tier.get_many(requests[:3])
        assert [bytes(p) for p in later] == [p for _, _, p in items[:3]]
        assert _address(later[0]) != _address(held[0])
        assert tier.get_many(requests[3:]) == [p for _, _, p in items[3:]]
    assert [bytes(p) for p in held] == [p for _, _, p in items[:3]]
    address = _address(held[0])
    del held, later
    assert _address(tier.get_many(requests[:3])[0]) == address


def test_get_many_reads_a_file_that_grew_on_its_own(tmp_path, caplog):
    """A file longer than when indexed (another process replaced it) does not fit the batch's buffer: it is
    read alone, and a whole block in it still loads."""
    items = entries(3)
    tier = disk(tmp_path)
    store(tier, items)
    h, k, p = items[1]
    tier._index.add(h, 10)  # as if indexed from a shorter file
    requests = [(h, k) for h, k, _ in items]
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        assert tier.get_many(requests) == [p for _, _, p in items]
    assert not [r for r in caplog.records if "skipping" in r.getMessage()]


def test_get_many_buffer_held_by_what_is_derived_from_a_payload(tmp_path):
    """Whatever is derived from a payload (a slice of it, a numpy array over it) keeps the read buffer from the
    next load, as the payload itself does; once the last of them is gone, the buffer is reused."""
    items = entries(3)
    tier = disk(tmp_path)
    store(tier, items)
    requests = [(h, k) for h, k, _ in items]
    payloads = tier.get_many(requests)
    address = _address(payloads[0])
    derived = np.frombuffer(payloads[1], dtype=np.uint8)[3:]
    tail = payloads[2][1:]
    expected = (bytes(derived), bytes(tail))
    del payloads
    for _ in range(2):
        again = tier.get_many(requests)
        assert _address(again[0]) != address
        assert (bytes(derived), bytes(tail)) == expected
        del again
    del derived
    assert _address(tier.get_many(requests)[0]) != address  # the slice still holds it
    del tail
    assert _address(tier.get_many(requests)[0]) == address
