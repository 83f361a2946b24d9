"""Partial last blocks through the KV offload tier, at the scheduler (kv_offload.connector's module docstring), on
the fake runner of tests/core/fake_runner.py: its cache holds one token id per slot and every step reads each
sequence's context back, so a partial block loaded with the wrong tokens, in the wrong place, or overwritten
changes the output. Conversations (each turn's prompt: the last prompt, its expected answer, new tokens) with
the pool's and the tier's invariants checked (test_scheduler_tier.py)."""
import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from fake_runner import Arrival, assert_pool_whole, drive, expected_outputs  # noqa: E402
from test_scheduler_tier import TierFakeRunner, check_tier, drive_and_check, tiered_scheduler  # noqa: E402

_EXAMPLES = {"ci": 40, "deep": 2000}.get(os.environ.get("KVPAGE_HYPOTHESIS_PROFILE", "ci"), 40)


def conversation(first: list[int], turns: list[tuple[int, list[int]]], n: int, name: str, start: int,
                 gap: int = 30) -> list[Arrival]:
    """One arrival per turn, `gap` steps apart: turn t's prompt is turn t-1's, its first expected sample and
    the turn's new tokens."""
    arrivals, prompt = [], first
    for t, (max_tokens, new) in enumerate(turns):
        arrivals.append(Arrival(start + gap * t, f"{name}t{t}", prompt, max_tokens, n))
        prompt = prompt + expected_outputs(prompt, max_tokens, n)[0] + new
    return arrivals


def test_the_next_turn_loads_the_partial_block():
    """Turn 1 (17 prompt tokens, 3 answer tokens) ends with 3 computed tokens in block 4; turn 2 finds blocks
    0-3 in the pool and those 3 tokens in the tier: 19 cached tokens, one block loaded, the same output."""
    s, tier, connector = tiered_scheduler(32, 4, 0, 64, max_num_batched_tokens=64, max_num_seqs=4)
    first = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 2]
    answer = expected_outputs(first, 3)[0]
    assert len(answer) == 3  # no early stop: 17 + 2 computed tokens
    arrivals = conversation(first, [(3, [5, 6, 7]), (2, [])], 1, "c", 0)
    runner = TierFakeRunner(s, tier)
    result = drive(s, arrivals, runner=runner)
    assert result.outputs["ct1"] == expected_outputs(arrivals[1].prompt, 2)
    assert connector.partial_stored_blocks >= 1 and connector.partial_hit_tokens == 3
    assert connector.hit_tokens == 3 and connector.loaded_blocks == 1 == runner.num_loads
    check_tier(tier, 4)
    assert_pool_whole(s.bm)


def test_a_partial_hit_counts_in_num_cached_tokens():
    s, tier, connector = tiered_scheduler(32, 4, 0, 64, max_num_batched_tokens=64, max_num_seqs=4)
    first = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 2]
    arrivals = conversation(first, [(3, [5, 6, 7]), (2, [])], 1, "c", 0)
    requests = {}
    add_request = s.add_request

    def keep(request_id, *args, **kwargs):
        requests[request_id] = add_request(request_id, *args, **kwargs)
        return requests[request_id]

    s.add_request = keep
    drive(s, arrivals, runner=TierFakeRunner(s, tier))
    assert requests["ct1"].num_cached_tokens == 16 + 3


turn = st.tuples(st.integers(1, 9), st.lists(st.integers(1, 9), max_size=8))


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convs=st.lists(st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=14),
                                st.lists(turn, min_size=2, max_size=3), st.sampled_from([1, 1, 2])),
                      min_size=1, max_size=4),
       block_size=st.sampled_from([2, 4]), num_blocks=st.integers(24, 60), num_host_blocks=st.integers(0, 30),
       tier_blocks=st.integers(1, 64), max_num_batched_tokens=st.integers(4, 48),
       mode=st.sampled_from([None, "swap", "recompute"]), fail_steps=st.sets(st.integers(0, 90), max_size=3),
       write_through=st.booleans())
def test_random_conversations_through_partial_blocks(convs, block_size, num_blocks, num_host_blocks, tier_blocks,
                                                     max_num_batched_tokens, mode, fail_steps, write_through):
    """Interleaved conversations, n > 1 among them, small pools and tiers, both preemption modes, failed steps:
    every turn's output is the expected one, the pool and the tier stay consistent."""
    arrivals = [a for c, (first, turns, n) in enumerate(convs)
                for a in conversation(first, turns, n, f"c{c}", c)]
    s, tier, connector = tiered_scheduler(num_blocks, block_size, num_host_blocks, tier_blocks, write_through,
                                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8,
                                          preemption_mode=mode)
    drive_and_check(s, tier, connector, arrivals, fail_steps)
    assert connector.hit_tokens >= connector.partial_hit_tokens >= 0
