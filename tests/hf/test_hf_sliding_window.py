"""kvpage.PagedCache for models with sliding-window layers, logit softcapping and attention sinks (Gemma 2, Gemma 3,
Mistral, Qwen2 with use_sliding_window, gpt-oss): HF generate on it gives what generate on HF's own
DynamicCache with eager attention gives, past the window, for a left-padded batch, sampling and beam search."""
from __future__ import annotations

import pytest
import torch
from hf_helpers import generate_both, left_padded
from family_models import WINDOW_FAMILIES, family_model, random_prompts

NEW_TOKENS = 40


def generate_on_both(model, input_ids, attention_mask, seed: int = 0, **kwargs):
    """(eager attention on a DynamicCache, kvpage attention on a PagedCache of block_size 8), same seed; every
    row runs to max_new_tokens."""
    model.generation_config.eos_token_id = None
    pair = generate_both(model, input_ids, attention_mask, seed, {"block_size": 8}, "eager", **kwargs)
    return pair.reference, pair.paged, pair.cache


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_greedy_on_a_left_padded_batch_past_the_window(family):
    model = family_model(family)
    ids, mask = left_padded(random_prompts([41, 7, 26]), pad_id=0)
    reference, paged, cache = generate_on_both(model, ids, mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert torch.equal(paged, reference)
    assert cache.row_lengths() == [n + NEW_TOKENS - 1 for n in (41, 7, 26)]  # the last token is never fed back


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_seeded_sampling_and_beam_search(family):
    """Sampling reads the softcapped logits as HF's own forward computes them; beam search reorders
    the cache's rows (block tables) between steps."""
    model = family_model(family)
    ids, mask = left_padded(random_prompts([30, 19], seed=3), pad_id=0)
    reference, paged, _ = generate_on_both(model, ids, mask, seed=7, do_sample=True, max_new_tokens=24)
    assert torch.equal(paged, reference)
    reference, paged, _ = generate_on_both(model, ids, mask, do_sample=False, num_beams=3, max_new_tokens=24)
    assert torch.equal(paged, reference)
