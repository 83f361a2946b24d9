"""Speculation under tensor parallelism (TP=2 on CPU: a driver and one spawned worker): the k + 1 logits rows
of a speculating decode come back through the same step payload, and greedy tokens equal TP=1 without it."""
from __future__ import annotations

from kvpage import SamplingParams

from spec_helpers import NGRAM, PROMPTS, run, token_ids


def test_tp2_greedy_identical(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=32)
    ref, _ = run(tiny_dir, PROMPTS, params)
    outputs, llm = run(tiny_dir, PROMPTS, params, speculative_config=NGRAM, tensor_parallel_size=2, swap_space_gib=0)
    try:
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert token_ids(outputs) == token_ids(ref)
    assert stats["spec_decode_num_accepted_tokens"] > 0
