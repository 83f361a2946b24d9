"""The disk tier's payload checksum, kvpage._C.crc32c (CRC-32C), on every CPU kernel ISA this machine has (the
SSE4.2 crc32 streams and the portable table loop), against a bitwise pure-Python CRC-32C: every length up to
past the three-stream split, unaligned starts, chaining, and files written under one ISA read under another."""
import random
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (kvpage._C needs libtorch loaded)

from kvpage import _C, ops
from kvpage.kv_offload import disk_tier
from kvpage.kv_offload.disk_tier import DiskTier

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_tiers import FP, entries, store  # noqa: E402

# The interleaved path takes buffers of 3 x 2048 bytes or more: lengths around that split and its tail.
LENGTHS = list(range(0, 72)) + [6143, 6144, 6145, 6151, 6152, 9000, 12289, 20011]


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C bit by bit (reflected polynomial 0x82F63B78, initial and final inversion)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@pytest.fixture(params=ops.available_cpu_isas())
def cpu_isa(request):
    previous = ops.cpu_isa()
    ops.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        ops.set_cpu_isa(previous)


def test_reference_is_crc32c():
    # The CRC catalogue's check value for CRC-32C (the CRC of the nine ASCII digits): the reference itself is right.
    assert crc32c_reference(b"123456789") == 0xE3069283


def test_crc32c_matches_reference_any_length_and_alignment(cpu_isa):
    rng = random.Random(48)
    buf = bytes(rng.getrandbits(8) for _ in range(max(LENGTHS) + 16))
    view = memoryview(buf)
    for n in LENGTHS:
        start = rng.randrange(0, 16)  # the 8-byte head loop sees every misalignment
        data = view[start:start + n]
        want = crc32c_reference(data)
        assert _C.crc32c(data) == want, (cpu_isa, n, start)
        cut = rng.randrange(0, n + 1)
        assert _C.crc32c(data[cut:], _C.crc32c(data[:cut])) == want, (cpu_isa, n, cut)


def test_crc32c_uses_hardware_only_off_generic(cpu_isa):
    if cpu_isa == "generic":
        assert not _C.crc32c_uses_hardware()


def test_crc32c_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="data must be a contiguous bytes-like object"):
        _C.crc32c(12)
    with pytest.raises((ValueError, TypeError)):
        _C.crc32c(memoryview(b"abcdef")[::2])  # not contiguous


def test_files_written_on_one_isa_load_on_every_other(tmp_path, cpu_isa):
    """The checksum is one function: a block written with the crc32 instruction loads on the portable loop and
    the other way round (a tier directory moves between machines)."""
    items = [(h, k, p * 80) for h, k, p in entries(3)]  # payloads past the three-stream split
    writer = DiskTier(tmp_path, FP, 1 << 22)
    store(writer, items)
    for isa in ops.available_cpu_isas():
        ops.set_cpu_isa(isa)
        reader = DiskTier(tmp_path, FP, 1 << 22)
        assert all(reader.get(h, k) == p for h, k, p in items), isa


def test_file_header_holds_the_payloads_crc32c(tmp_path):
    h, k, p = entries(1)[0]
    tier = DiskTier(tmp_path, FP, 1 << 20)
    store(tier, [(h, k, p)])
    data = tier._path(h).read_bytes()
    assert data[:len(disk_tier.MAGIC)] == disk_tier.MAGIC
    checksum = disk_tier._HEADER.unpack_from(data, len(disk_tier.MAGIC))[3]
    assert checksum == crc32c_reference(p).to_bytes(4, "little") + bytes(12)
