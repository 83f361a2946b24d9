"""TP=2 on the generic path (HF's modules, each rank a shard) for the Gemma families: sliding-window layers in
their own KV-cache groups, Gemma 2's softcaps, and Gemma's scaled input embedding (sqrt(hidden) times each
row, which the vocabulary-parallel embedding must apply too): greedy tokens equal HF eager generate's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kvpage
from family_models import family_pair, random_prompts
from greedy_driver import hf_greedy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from tp_helpers import generate_then_shut_down  # noqa: E402


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tp2_greedy_matches_hf(family):
    reference, model = family_pair(family)
    prompts = random_prompts([40, 9, 57])
    tp2 = kvpage.LLM(model=model, num_kv_blocks=64, block_size=8, tensor_parallel_size=2)
    outputs, stats = generate_then_shut_down(
        tp2, prompts, kvpage.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, prompts, 24)
    assert len(stats["kv_cache_groups"]) > 1  # the window layers in their own groups
