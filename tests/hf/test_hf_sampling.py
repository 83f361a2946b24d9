"""Sampling with a fixed seed draws the same tokens on a PagedCache as on DynamicCache."""
from __future__ import annotations

import torch

from hf_helpers import generate_both, left_padded
from tiny_models import random_prompts, tiny_model


def test_default_model_sampling(default_model):
    model, tokenizer = default_model
    prompts = [tokenizer.encode(t) for t in ("Write a short poem about autumn:", "My favourite food is", "Q: Why is"
                                             " the sky blue?\nA:")]
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    pair = generate_both(model, ids, mask, seed=1234, do_sample=True, temperature=0.9, top_k=50, top_p=0.95,
                         max_new_tokens=12)
    assert torch.equal(pair.paged, pair.reference)


def test_qwen2_sampling_several_return_sequences():
    model = tiny_model("qwen2")
    ids, mask = left_padded(random_prompts([9, 30], seed=3), pad_id=0)
    pair = generate_both(model, ids, mask, seed=7, do_sample=True, temperature=1.3, num_return_sequences=3,
                         max_new_tokens=20, pad_token_id=0)
    assert torch.equal(pair.paged, pair.reference)
    assert len(set(map(tuple, pair.paged[:, ids.shape[1]:].tolist()))) > 1  # the samples differ
