"""Greedy HF generate on a PagedCache is token-identical to HF's default DynamicCache (fp32), for one
prompt and for a left-padded batch of 8, on the default model (Llama) and a random Qwen2."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_helpers import blocks_for, generate_both, left_padded
from kvpage import PagedCache
from tiny_models import random_prompts, tiny_model

# Lengths far apart, so a left-padded batch is mostly padding in its short rows.
TEXTS = [
    "The capital of France is", "2+2=", "Once upon a time, in a small village by the sea, there lived an old"
    " fisherman who every morning", "List three colors:", "def fibonacci(n):", "Paged attention stores the KV"
    " cache in fixed-size blocks, so that memory is allocated on demand and shared between sequences. Its main"
    " benefit is", "Hello", "The three laws of thermodynamics are",
]
MAX_NEW = 12


def _chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def test_default_model_one_prompt(default_model):
    model, tokenizer = default_model
    ids = torch.tensor([_chat_ids(tokenizer, "What is the capital of France?")])
    pair = generate_both(model, ids, torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(pair.paged, pair.reference)
    assert "Paris" in tokenizer.decode(pair.paged[0, ids.shape[1]:])


def test_default_model_left_padded_batch_of_8(default_model):
    model, tokenizer = default_model
    prompts = [tokenizer.encode(t) for t in TEXTS]
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    pair = generate_both(model, ids, mask, do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    assert torch.equal(pair.paged, pair.reference)
    # Each row holds its own tokens only: padding took no slot and no block.
    cache, bs = pair.cache, pair.cache.block_size
    held = [len(p) + MAX_NEW - 1 for p in prompts]  # the last token is sampled, never fed back
    assert cache.row_lengths() == held
    stats = cache.stats()
    assert stats.num_blocks_used == stats.peak_blocks_used == sum(blocks_for(n, bs) for n in held)
    assert stats.peak_blocks_used < len(prompts) * blocks_for(ids.shape[1] + MAX_NEW - 1, bs)  # padded: batch x longest


@pytest.mark.parametrize("batch", [1, 8])
def test_qwen2_greedy(batch):
    model = tiny_model("qwen2")
    prompts = random_prompts([37, 5, 90, 1, 16, 17, 64, 33][:batch], seed=batch)
    ids, mask = left_padded(prompts, pad_id=0)
    pair = generate_both(model, ids, mask, cache_kwargs=dict(block_size=8), do_sample=False, max_new_tokens=24,
                         min_new_tokens=24, pad_token_id=0)
    assert torch.equal(pair.paged, pair.reference)
    assert pair.cache.row_lengths() == [len(p) + 23 for p in prompts]


def test_past_key_values_spelling():
    """Existing code passes the cache as past_key_values= (the name before transformers' rename to cache=)."""
    model = tiny_model("llama")
    ids = torch.tensor(random_prompts([11]))
    model.set_attn_implementation("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecation of the old name, not ours
        reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), do_sample=False,
                                   max_new_tokens=8)
        model.set_attn_implementation("kvpage")
        cache = PagedCache(model.config)
        paged = model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=8)
    assert torch.equal(paged, reference)
    assert cache.get_seq_length() == ids.shape[1] + 7


def test_chunked_prefill_with_rows_all_padding_in_a_chunk():
    """HF's prefill_chunk_size feeds the prompt 8 columns at a time: early chunks are all padding for the
    short rows, which then take no slot, no block and no attention."""
    model = tiny_model("llama")
    prompts = random_prompts([5, 30, 17], seed=13)
    ids, mask = left_padded(prompts, pad_id=0)
    pair = generate_both(model, ids, mask, do_sample=False, max_new_tokens=10, pad_token_id=0, prefill_chunk_size=8)
    assert torch.equal(pair.paged, pair.reference)
    assert pair.cache.row_lengths() == [len(p) + 9 for p in prompts]
