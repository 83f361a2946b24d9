"""A KV offload tier behind a hybrid KV cache (issue 48 on issue 45's layouts): a tiny random-weight model with
sliding-window and full-attention layers (Qwen2's use_sliding_window, two of each: two KV-cache groups), a pool small
enough that every wave evicts the one before. Greedy tokens equal the tier-off engine's (and HF generate's)
with a host tier, a disk tier and after a restart on the same directory; a window group loads only the blocks
of its window, so a hit loads fewer blocks than a full group's chain in every group would take."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_helpers import (BLOCK, GREEDY, PROMPTS, assert_window_loads_only, engine, generate,  # noqa: E402
                            qwen2_sliding, waves)


@pytest.fixture(scope="module")
def model():
    return qwen2_sliding()


@pytest.fixture(scope="module")
def reference(model):
    """Tier off, same pool; its first wave equals HF generate's greedy tokens."""
    off = engine(model)
    assert off.kv_cache_layout.num_groups == 2 and off.kv_cache_layout.is_hybrid
    got = waves(off)
    config = GenerationConfig(do_sample=False, max_new_tokens=GREEDY.max_tokens, pad_token_id=0)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None  # ignore_eos
    try:
        with torch.inference_mode():
            hf = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=config)[0, len(p):].tolist() for p in PROMPTS[:2]]
    finally:
        model.generation_config.eos_token_id = saved
    assert got[0][:2] == hf
    return got


@pytest.mark.parametrize("where", ["host", "disk"])
def test_hybrid_same_tokens_with_the_tier(model, reference, tmp_path, where):
    llm = engine(model, kv_offloading_size=0.05, kv_offloading_dir=str(tmp_path) if where == "disk" else None)
    assert waves(llm) == reference
    stats = llm.stats()
    assert stats["kv_offload_stored_blocks"] > 0
    assert_window_loads_only(stats)
    assert stats["kv_blocks_used"] == 0


def test_hybrid_restart_with_the_same_directory(model, reference, tmp_path):
    first = engine(model, kv_offloading_dir=str(tmp_path))
    assert generate(first) == reference[0]
    dropped = first.stats()["kv_offload_dropped_blocks"]  # the disk writer's queue was full (a slow disk)
    first.shutdown()  # persists what the pool still caches
    second = engine(model, kv_offloading_dir=str(tmp_path), num_kv_blocks=256)  # a pool that evicts nothing
    assert generate(second) == reference[0]
    stats = second.stats()
    assert_window_loads_only(stats)
    # Every prompt's blocks before its last token were on disk (unless a write was dropped): all hits.
    assert dropped or stats["prefix_cache_hit_tokens"] == sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)


def test_hybrid_under_preemption(model, reference, tmp_path):
    """A pool that runs the prompts concurrently only by preempting (recompute): re-admissions may load their
    evicted blocks back, windows included."""
    off = engine(model, num_kv_blocks=48, preemption_mode="recompute")
    on = engine(model, num_kv_blocks=48, preemption_mode="recompute", kv_offloading_size=0.05,
                kv_offloading_dir=str(tmp_path))
    assert waves(on) == waves(off)
    assert on.stats()["num_preemptions"] > 0 and on.stats()["kv_offload_loaded_blocks"] > 0
