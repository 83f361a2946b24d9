"""The KV offload tier's batch ops in kvpage._C, on every CPU kernel ISA this machine has and on one and two op
threads: write_kv_blocks / read_kv_blocks (a batch of block payloads into and out of per-tensor caches) against
numpy slice assignments of the same bytes, read_kv_files (a load's files read and checksummed) against the
files' bytes and crc32c, and load_kv_files (block files read straight into the cache rows) against both; bad
arguments are named."""
import errno
import os
import random

import numpy as np
import pytest
import torch

from kvpage import _C, ops

NUM_BLOCKS = 12


@pytest.fixture(params=[(isa, threads) for isa in ops.available_cpu_isas() for threads in (1, 2)],
                ids=lambda p: f"{p[0]}-{p[1]}threads")
def cpu_isa(request):
    isa, threads = request.param
    previous_isa, previous_threads = ops.cpu_isa(), torch.get_num_threads()
    ops.set_cpu_isa(isa)
    torch.set_num_threads(threads)
    try:
        yield isa
    finally:
        ops.set_cpu_isa(previous_isa)
        torch.set_num_threads(previous_threads)


def caches(seed=0):
    """Per-tensor caches as the worker sees them (numpy byte rows of torch tensors, one row per block): K and V of
    three layers of different widths, float32 and bfloat16, random bytes."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for heads, dtype in ((2, torch.float32), (1, torch.bfloat16), (3, torch.float32)):
        for _ in ("k", "v"):
            tensors.append(torch.randn(NUM_BLOCKS, heads, 4, 8, generator=g).to(dtype))
    return tensors, [t.view(NUM_BLOCKS, -1).view(torch.uint8).numpy() for t in tensors]


def payloads(views, n, seed=0):
    """n random payloads, as views of one buffer (as a load's are), with the offset of a block's tensor rows."""
    total = sum(v.shape[1] for v in views)
    rng = np.random.default_rng(seed)
    arena = rng.integers(0, 256, size=n * total + 5, dtype=np.uint8)
    return [memoryview(arena[5 + i * total:5 + (i + 1) * total]) for i in range(n)]


def write_by_slices(views, block_ids, rows):
    """The reference: every (block, tensor) row by a numpy slice assignment."""
    for block_id, payload in zip(block_ids, rows):
        row, offset = np.frombuffer(payload, dtype=np.uint8), 0
        for view in views:
            view[block_id] = row[offset:offset + view.shape[1]]
            offset += view.shape[1]


def test_write_kv_blocks_matches_slice_assignments(cpu_isa):
    tensors, views = caches()
    expected_tensors, expected = caches()
    block_ids = [7, 0, 11, 3, 5]
    rows = payloads(views, len(block_ids))
    _C.write_kv_blocks(rows, block_ids, views)
    write_by_slices(expected, block_ids, rows)
    for t, want in zip(tensors, expected_tensors):  # written blocks the payloads' bytes, the others untouched
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))


def test_read_kv_blocks_is_each_blocks_rows_in_order(cpu_isa):
    tensors, views = caches(seed=1)
    block_ids = [4, 4, 9, 0, 2, 10, 1]
    out = [memoryview(bytearray(sum(v.shape[1] for v in views))) for _ in block_ids]
    _C.read_kv_blocks(out, block_ids, views)
    for block_id, row in zip(block_ids, out):
        assert bytes(row) == b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    # And back: written into other blocks, then read again, the same bytes.
    _C.write_kv_blocks(out[:3], [1, 2, 3], views)
    again = [bytearray(len(out[0])) for _ in range(3)]
    _C.read_kv_blocks(again, [1, 2, 3], views)
    assert [bytes(a) for a in again] == [bytes(r) for r in out[:3]]


def test_kv_blocks_bad_arguments_are_named():
    _, views = caches()
    total = sum(v.shape[1] for v in views)
    good = bytes(total)
    with pytest.raises(ValueError, match="same length"):
        _C.write_kv_blocks([good], [1, 2], views)
    with pytest.raises(ValueError, match=rf"payloads\[1\] has {total - 1} bytes.*takes {total}"):
        _C.write_kv_blocks([good, good[:-1]], [1, 2], views)
    with pytest.raises(ValueError, match=rf"block_ids\[0\] = {NUM_BLOCKS} is outside caches\[0\]"):
        _C.write_kv_blocks([good], [NUM_BLOCKS], views)
    with pytest.raises(ValueError, match=r"block_ids\[0\] = -1"):
        _C.read_kv_blocks([bytearray(total)], [-1], views)
    with pytest.raises(TypeError, match=r"caches\[2\] must be a writable"):
        _C.write_kv_blocks([good], [1], views[:2] + [bytes(views[2].nbytes)] + views[3:])
    with pytest.raises(TypeError, match=r"payloads\[0\] must be a writable"):
        _C.read_kv_blocks([good], [1], views)
    with pytest.raises(ValueError, match="at least one cache"):
        _C.write_kv_blocks([], [], [])


def test_read_kv_files_bytes_and_checksums(cpu_isa, tmp_path):
    rng = random.Random(48)
    sizes = [0, 1, 100, 6143, 6144, 70_001, 300_000]
    paths, contents = [], []
    for i, size in enumerate(sizes):
        data = bytes(rng.getrandbits(8) for _ in range(min(size, 4096))) * (size // 4096 + 1)
        contents.append(data[:size])
        paths.append(str(tmp_path / f"f{i}"))
        (tmp_path / f"f{i}").write_bytes(contents[-1])
    starts = [min(rng.randrange(0, 200), size) for size in sizes]
    arena = np.zeros(sum(sizes) + 64, dtype=np.uint8)
    views, offset = [], 3  # unaligned, one after another in one buffer
    for size in sizes:
        views.append(memoryview(arena[offset:offset + size]))
        offset += size
    reads = _C.read_kv_files(paths, views, starts)
    for (error, size, crc), data, view, start in zip(reads, contents, views, starts):
        assert (error, size) == (0, len(data)) and bytes(view) == data
        assert crc == _C.crc32c(data[start:])


def test_read_kv_files_reports_errors_and_files_too_big(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 100)
    (tmp_path / "ok").write_bytes(b"y" * 10)
    (tmp_path / "dir").mkdir()
    buffers = [bytearray(50), bytearray(10), bytearray(10), bytearray(10)]
    paths = [str(tmp_path / name) for name in ("big", "missing", "dir", "ok")]
    big, missing, directory, ok = _C.read_kv_files(paths, buffers, [0, 0, 0, 20])
    assert big == (0, 100, 0) and bytes(buffers[0]) == bytes(50)  # too big: its size, nothing read
    assert missing[0] == errno.ENOENT and directory[0] == errno.EISDIR  # not a regular file: not read
    assert ok == (0, 10, 0) and bytes(buffers[3]) == b"y" * 10  # crc_start past the end: no checksum
    with pytest.raises(ValueError, match="same length"):
        _C.read_kv_files(paths, buffers[:3], [0] * 4)
    with pytest.raises(TypeError, match=r"buffers\[1\] must be a writable"):
        _C.read_kv_files(paths[:2], [bytearray(1), b"x"], [0, 0])
    with pytest.raises(ValueError, match=r"crc_starts\[0\] must be >= 0"):
        _C.read_kv_files(paths[:1], buffers[:1], [-1])
    assert os.path.exists(paths[0])


def block_files(tmp_path, views, n, seed=0):
    """n block files as the disk tier lays them out: a header of a few bytes (different per file), then the block's
    row of every cache in turn. (paths, sizes, offsets, payloads)."""
    paths, sizes, offsets = [], [], []
    rows = payloads(views, n, seed)
    for i, row in enumerate(rows):
        header = bytes([i + 1]) * (17 + 5 * i)
        (tmp_path / f"b{i}").write_bytes(header + bytes(row))
        paths.append(str(tmp_path / f"b{i}"))
        offsets.append(len(header))
        sizes.append(len(header) + len(row))
    return paths, sizes, offsets, rows


def test_load_kv_files_reads_into_the_rows_and_checksums(cpu_isa, tmp_path):
    """The disk tier's load straight into the cache: the rows as write_kv_blocks of the files' payloads would leave
    them, each file's CRC-32C that of its payload."""
    tensors, views = caches(seed=2)
    expected_tensors, expected = caches(seed=2)
    block_ids = [9, 2, 0, 11, 6]
    paths, sizes, offsets, rows = block_files(tmp_path, views, len(block_ids))
    results = _C.load_kv_files(paths, sizes, offsets, block_ids, views)
    assert results == [(0, size, _C.crc32c(row)) for size, row in zip(sizes, rows)]
    write_by_slices(expected, block_ids, rows)
    for t, want in zip(tensors, expected_tensors):
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))


def test_load_kv_files_large_unaligned_rows(cpu_isa, tmp_path):
    """Rows of odd sizes (unaligned, one of them longer than the load's 256 KiB read chunk, others a few bytes):
    every chunk and row boundary falls somewhere else, the checksum's three-stream and tail paths all run."""
    widths = (300_007, 6151, 3, 20_000)
    rng = np.random.default_rng(7)
    views = [rng.integers(0, 256, size=(4, w), dtype=np.uint8) for w in widths]
    expected = [v.copy() for v in views]
    block_ids = [3, 1]
    paths, sizes, offsets, rows = block_files(tmp_path, views, len(block_ids), seed=5)
    results = _C.load_kv_files(paths, sizes, offsets, block_ids, views)
    assert results == [(0, size, _C.crc32c(row)) for size, row in zip(sizes, rows)]
    write_by_slices(expected, block_ids, rows)
    assert all(np.array_equal(v, e) for v, e in zip(views, expected))


def test_load_kv_files_reports_errors_and_reads_no_other_file(tmp_path):
    """A file missing, not a regular file, or of another size than the caller checked: its errno or its size, and
    its rows untouched (a file of another size is not the one whose header was checked)."""
    tensors, views = caches(seed=3)
    before = [t.clone() for t in tensors]
    paths, sizes, offsets, _ = block_files(tmp_path, views, 3)
    (tmp_path / "dir").mkdir()
    with open(paths[2], "ab") as f:
        f.write(b"+")
    results = _C.load_kv_files([str(tmp_path / "missing"), str(tmp_path / "dir"), paths[2]], sizes, offsets,
                               [1, 2, 3], views)
    assert results[0][0] == errno.ENOENT and results[1][0] == errno.EISDIR
    assert results[2] == (0, sizes[2] + 1, 0)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_load_kv_files_bad_arguments_are_named(tmp_path):
    _, views = caches()
    paths, sizes, offsets, _ = block_files(tmp_path, views, 2)
    with pytest.raises(ValueError, match="same length"):
        _C.load_kv_files(paths, sizes[:1], offsets, [1, 2], views)
    with pytest.raises(ValueError, match=r"sizes\[1\] must be offsets\[1\] \+ a block's bytes"):
        _C.load_kv_files(paths, [sizes[0], sizes[1] - 1], offsets, [1, 2], views)
    with pytest.raises(ValueError, match=rf"block_ids\[1\] = {NUM_BLOCKS} is outside caches\[0\]"):
        _C.load_kv_files(paths, sizes, offsets, [1, NUM_BLOCKS], views)
    with pytest.raises(TypeError, match=r"caches\[1\] must be a writable"):
        _C.load_kv_files(paths, sizes, offsets, [1, 2], views[:1] + [bytes(views[1].nbytes)] + views[2:])
