"""Speculation on a hybrid KV cache (sliding-window groups beside a full one, Gemma 3's layer pattern): the
lookahead slots are appended in every group, a window group frees what leaves the window only after the
accepted tokens count as computed, and greedy tokens equal those without speculation."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import kvpage
from kvpage import SamplingParams

from spec_helpers import NGRAM, assert_no_leaks, token_ids

WINDOW = 12
LAYER_TYPES = ["full_attention" if (l + 1) % 3 == 0 else "sliding_attention" for l in range(3)]


def gemma3_like():
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                              sliding_window=WINDOW, query_pre_attn_scalar=32, layer_types=LAYER_TYPES,
                              initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
    return Gemma3ForCausalLM(config).eval()


def prompts() -> list[list[int]]:
    """Repeated random phrases: the n-gram proposer finds matches, the model sometimes follows them."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n, reps in ((7, 6), (5, 9), (11, 4)):
        phrase = torch.randint(3, 128, (n,), generator=g).tolist()
        out.append(phrase * reps)
    return out


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_hybrid_greedy_identical(mode):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    options = dict(num_kv_blocks=56, block_size=4, max_num_batched_tokens=16, preemption_mode=mode, swap_space_gib=0.01)
    ref = kvpage.LLM(model=gemma3_like(), **options).generate(prompts() * 2, params, use_tqdm=False)
    llm = kvpage.LLM(model=gemma3_like(), speculative_config=NGRAM, **options)
    outputs = llm.generate(prompts() * 2, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(ref)
    stats = llm.stats()
    assert any(g["sliding_window"] == WINDOW for g in stats["kv_cache_groups"])
    assert stats[f"num_{mode}_preemptions"] > 0
    assert stats["spec_decode_num_drafts"] > 0
    assert_no_leaks(llm)
