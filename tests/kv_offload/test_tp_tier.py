"""KV offload tiers under tensor parallelism: TP=2 on CPU (gloo, the driver and one spawned worker) on the hybrid
model of test_hybrid_tier.py (two KV-cache groups, one KV head per rank). Each rank stores and loads its own
shard of every block in its own tier; the driver's connector owns the lookup and every rank verifies its
entries before a hit counts. Greedy tokens equal TP=2's with the tier off across eviction and reload (host
memory), after a restart on one directory (disk: one fingerprint directory per rank), and when one rank's
files are damaged (its checks fail, so those hits are recomputed)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_helpers import assert_window_loads_only, engine, generate, qwen2_sliding, waves  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return qwen2_sliding()


def run(llm, fn):
    """fn(llm), then the LLM's stats; its workers are shut down (a disk tier persisted) whatever happens."""
    try:
        return fn(llm), llm.stats()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(model):
    """TP=2, tier off, the same pool."""
    return run(engine(model, tensor_parallel_size=2), waves)[0]


def test_tp2_host_tier_same_tokens(model, reference):
    got, stats = run(engine(model, tensor_parallel_size=2, kv_offloading_size=0.05), waves)
    assert got == reference
    assert stats["kv_offload_stored_blocks"] > 0
    assert_window_loads_only(stats)


def test_tp2_disk_tier_restart_and_a_damaged_rank(model, reference, tmp_path):
    first = engine(model, tensor_parallel_size=2, kv_offloading_dir=str(tmp_path))
    rank0 = first.llm_engine.kv_connector.tier.fingerprint
    assert run(first, generate)[0] == reference[0]
    dirs = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(dirs) == 2 and rank0 in {d.name for d in dirs}  # one fingerprint (and directory) per rank
    assert all(list(d.rglob("*.kvb")) for d in dirs)

    def restart():
        llm = engine(model, tensor_parallel_size=2, kv_offloading_dir=str(tmp_path), num_kv_blocks=256)
        return run(llm, generate)

    got, warm = restart()
    assert got == reference[0]
    assert_window_loads_only(warm)
    rank1 = next(d for d in dirs if d.name != rank0)
    for path in rank1.rglob("*.kvb"):  # a flipped bit in every block file of rank 1 only
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x10
        path.write_bytes(bytes(data))
    got, damaged = restart()
    assert got == reference[0]
    assert damaged["kv_offload_hit_tokens"] < warm["kv_offload_hit_tokens"]


def test_a_ranks_probe_reads_in_batches_and_answers_each_entry(tmp_path):
    """A worker rank's probe reads the entries it has not verified through get_many (one batch up to and including
    a miss, then the next after it), keeps the verified payloads for the schedule, and answers each entry."""
    from types import SimpleNamespace

    from test_tiers import FP, entries, store

    from kvpage.kv_offload.disk_tier import DiskTier
    from kvpage.kv_offload.tp import RankOffload

    items = entries(6)
    tier = DiskTier(tmp_path, FP, 1 << 20)
    store(tier, items[:2] + items[3:])  # block 2 missing
    batches = []
    get_many = tier.get_many
    tier.get_many = lambda requests: (batches.append(len(requests)), get_many(requests))[1]
    rank = RankOffload.__new__(RankOffload)
    rank.rank, rank.worker, rank._pending, rank._epoch = 1, SimpleNamespace(tier=tier), {}, -1
    requests = [(h, k) for h, k, _ in items]
    assert rank.probe(0, requests) == [1, 1, 0, 1, 1, 1] and batches == [6, 3]
    assert {h: bytes(p) for h, p in rank._pending.items()} == {h: p for h, _, p in items[:2] + items[3:]}
    assert rank.probe(0, requests[:2]) == [1, 1] and batches == [6, 3]  # verified in this schedule: not read again
