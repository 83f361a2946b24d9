"""A failed step is recovered (Scheduler.recover): an exception anywhere in schedule() (here from inside
the block pools and the block manager, after or before they changed something) requeues the step's
requests, and each still ends with the output of an undisturbed run; one in update_from_output()
finishes (aborts) the requests the step scheduled, with a prefix of that output. The pools stay whole.

The fake runner (fake_runner.py) reads every context back from its fake KV cache, so a request that
went on trusting a slot a failed step overwrote would change its output and fail the test.
"""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from fake_runner import LAYOUTS, Arrival, FakeRunner, assert_pool_whole, check_output, expected_outputs
from kvpage.core import BlockManager, Scheduler, check_block_manager


class Injected(Exception):
    pass


class Faults:
    """Wraps block-manager and pool methods: while armed, each call raises with probability `rate`,
    half the time after doing its work (the worst case: a change nobody recorded). Fires once per
    arming, so the recovery itself runs undisturbed."""

    POOL = ("allocate", "incref", "decref", "uncache")
    MANAGER = ("allocate", "append_slots", "mark_computed", "fork", "free", "swap_out", "swap_in", "slot_mapping",
               "slot_mappings", "note_computing")

    def __init__(self, bm: BlockManager, rng: random.Random, rate: float) -> None:
        self.rng, self.rate, self.armed, self.fired = rng, rate, False, 0
        for obj, names in ((bm.device, self.POOL), (bm.host, self.POOL), (bm, self.MANAGER)):
            for name in names:
                setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, method):
        def flaky(*args, **kwargs):
            if not (self.armed and self.rng.random() < self.rate):
                return method(*args, **kwargs)
            self.armed = False
            self.fired += 1
            if self.rng.random() < 0.5:
                method(*args, **kwargs)
            raise Injected(method.__name__)
        return flaky


def _workload(seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    prefixes = [[], [5] * 8, list(range(1, 13))]
    return [Arrival(rng.randrange(8), f"r{i}", rng.choice(prefixes) + [rng.randrange(1, 64) for _ in range(rng.randint(1, 16))],
                    rng.randint(1, 16), n=rng.choice([1, 1, 2])) for i in range(16)]


def _run(scheduler: Scheduler, arrivals: list[Arrival], faults: Faults) -> tuple[dict, set[str]]:
    runner = FakeRunner(scheduler.bm.block_size, scheduler.bm.sliding_windows)
    pending, requests, aborted = sorted(arrivals, key=lambda a: a.step), {}, set()
    for step in range(20_000):
        if not pending and not scheduler.has_unfinished_requests():
            break
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            requests[a.request_id] = scheduler.add_request(a.request_id, a.prompt, max_tokens=a.max_tokens, n=a.n,
                                                           eos_token_id=0)
        faults.armed = True
        try:
            out = scheduler.schedule()
        except Injected:
            assert scheduler.pending is None
        else:
            faults.armed = False
            check_output(scheduler, out)
            sampled = runner.execute(out, lambda seq_id: scheduler._seqs[seq_id].token_ids)
            faults.armed = True
            try:
                scheduler.update_from_output(out, sampled)
            except Injected:
                assert scheduler.pending is None
                aborted.update(s.request_id for s in out.scheduled)
                assert all(requests[rid].status.is_finished for rid in aborted)
        faults.armed = False
        check_block_manager(scheduler.bm, [s for r in scheduler.requests.values() for s in r.live_seqs()])
    else:
        raise AssertionError("the workload did not finish")
    return {rid: [seq.output_token_ids for seq in r.seqs] for rid, r in requests.items()}, aborted


@settings(max_examples=25)
@given(seed=st.integers(0, 10**6), rate=st.sampled_from([0.005, 0.02, 0.05]), block_size=st.sampled_from([2, 4]),
       num_blocks=st.integers(48, 96), num_host_blocks=st.sampled_from([0, 32]), prefix_caching=st.booleans(),
       mode=st.sampled_from(["swap", "recompute"]), layout=st.sampled_from(LAYOUTS[:3]))
def test_faults_in_the_bookkeeping_never_change_an_output(seed, rate, block_size, num_blocks, num_host_blocks,
                                                          prefix_caching, mode, layout):
    arrivals = _workload(seed)
    groups = 1 if layout is None else layout.num_groups  # a window group may hold a whole chunk: count it full
    bm = BlockManager(num_blocks * groups, block_size, num_host_blocks * groups, prefix_caching, kv_cache_layout=layout)
    scheduler = Scheduler(bm, max_num_batched_tokens=32, max_num_seqs=8,
                          preemption_mode=mode if num_host_blocks else "recompute")
    faults = Faults(bm, random.Random(seed), rate)
    outputs, aborted = _run(scheduler, arrivals, faults)
    for a in arrivals:
        expected = expected_outputs(a.prompt, a.max_tokens, a.n)
        if a.request_id in aborted:  # each sample so far is a prefix of its undisturbed output
            got = outputs[a.request_id]
            assert all(any(e[:len(g)] == g for e in expected) for g in got), a.request_id
        else:
            assert outputs[a.request_id] == expected, a.request_id
    assert_pool_whole(bm)
    assert rate < 0.02 or faults.fired > 0


def test_a_torn_pool_is_rebuilt_from_the_tables():
    """A block taken off the free list but never counted (an interrupt inside BlockPool.allocate) is
    free again once the pools are rebuilt; a revived cached block stays a prefix hit."""
    bm = BlockManager(8, 2)
    s = Scheduler(bm)
    s.add_request("a", [1, 2, 3, 4, 5], max_tokens=2)
    out = s.schedule()
    s.update_from_output(out, {out.scheduled[0].seq_id: 7})
    bm.begin_step()  # the next step: the blocks indexed by the last one stay trusted
    bm.device._free.pop()  # torn: neither free nor referenced
    bm.recover(s.sequences())
    check_block_manager(bm, s.sequences())
    s.abort_request("a")
    assert_pool_whole(bm)
    assert bm.stats().num_cached_blocks == 2  # [1, 2] and [3, 4] stay hits
