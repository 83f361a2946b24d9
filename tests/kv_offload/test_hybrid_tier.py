"""A KV offload tier behind a hybrid KV cache (issue 48 on issue 45's layouts): a tiny random-weight model with
sliding-window and full-attention layers (Qwen2's use_sliding_window, two of each: two KV-cache groups), a pool small
enough that every wave evicts the one before. Greedy tokens equal the tier-off engine's (and HF generate's)
with a host tier, a disk tier and after a restart on the same directory; a window group loads only the blocks
of its window, so a hit loads fewer blocks than a full group's chain in every group would take."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

import kvpage
from kvpage import SamplingParams

WINDOW, BLOCK = 12, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def qwen2_sliding(seed: int = 0):
    """Qwen2 with use_sliding_window: layers 0-1 full attention, 2-3 a window of WINDOW (two KV-cache groups
    of two layers); weights large enough (initializer_range 0.3) that a token outside a window matters."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, initializer_range=0.3,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def make_prompts() -> list[list[int]]:
    """Eight prompts of 40-75 tokens, pairs sharing a 24-token prefix (several windows long)."""
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(3, 128, (24,), generator=g).tolist() for _ in range(4)]
    return [prefixes[i // 2] + torch.randint(3, 128, (16 + 5 * i,), generator=g).tolist() for i in range(8)]


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def model():
    return qwen2_sliding()


def engine(model, **kwargs):
    kwargs.setdefault("num_kv_blocks", 64)  # about two prompts' blocks in both groups: every wave evicts
    return kvpage.LLM(model=copy.deepcopy(model), block_size=BLOCK, max_num_batched_tokens=64, swap_space_gib=0.001,
                      **kwargs)


def generate(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def waves(llm, rounds: int = 2) -> list[list[list[int]]]:
    result = []
    for _ in range(rounds):
        result.append(generate(llm))
        if llm.llm_engine.kv_connector is not None:
            llm.llm_engine.kv_connector.tier.flush()
    return result


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


def assert_window_loads_only(stats, num_groups: int = 2) -> None:
    """Tier hits happened, and fewer blocks were loaded than every group's whole chain would take."""
    hit_blocks = stats["kv_offload_hit_tokens"] // BLOCK
    assert hit_blocks > 0
    assert hit_blocks < stats["kv_offload_loaded_blocks"] < num_groups * hit_blocks


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
    # Load every hit: on a loaded machine the measured prefill of this tiny model may price some loads higher.
    second.llm_engine.kv_connector.recompute_seconds = None
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
