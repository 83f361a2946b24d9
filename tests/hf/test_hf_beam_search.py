"""Beam search on a PagedCache is identical to DynamicCache, and reorders by re-pointing block tables:
beams share blocks by ref count and copy a shared block only when they append to it."""
from __future__ import annotations

import pytest
import torch

from hf_helpers import generate_both, left_padded
from tiny_models import random_prompts, tiny_model


@pytest.mark.parametrize("num_beams", [2, 4])
def test_default_model_beam_search(default_model, num_beams):
    model, tokenizer = default_model
    prompts = [tokenizer.encode(t) for t in ("The best way to learn a language is", "Water boils at")]
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    pair = generate_both(model, ids, mask, do_sample=False, num_beams=num_beams, max_new_tokens=8)
    assert torch.equal(pair.paged, pair.reference)
    assert pair.cache.stats().num_copy_on_write > 0  # beams did share blocks they then wrote into


@pytest.mark.parametrize("num_beams", [2, 4])
def test_qwen2_beam_search_all_beams_and_scores(num_beams):
    model = tiny_model("qwen2")
    prompts = random_prompts([21, 6, 40], seed=7)
    ids, mask = left_padded(prompts, pad_id=0)
    pair = generate_both(model, ids, mask, cache_kwargs=dict(block_size=8), do_sample=False, num_beams=num_beams,
                         num_return_sequences=num_beams, max_new_tokens=16, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, length_penalty=0.7)
    assert torch.equal(pair.paged.sequences, pair.reference.sequences)
    torch.testing.assert_close(pair.paged.sequences_scores, pair.reference.sequences_scores, rtol=1e-4, atol=1e-4)
    stats = pair.cache.stats()
    rows = len(prompts) * num_beams
    # After the reorders beams share their prompt blocks: far fewer blocks than rows x private copies.
    held = sum(pair.cache.row_lengths())
    assert stats.num_blocks_used < -(-held // 8)
    assert stats.num_copy_on_write > 0 and len(pair.cache.row_lengths()) == rows
