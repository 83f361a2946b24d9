"""PagedCache with use_cache=False (issue 49, finding 7): generate then feeds the whole sequence again at
every step, over a cache that already holds it; the refusal says so instead of only naming mask shapes."""
from __future__ import annotations

import copy

import pytest
import torch

import kvpage


def test_generate_with_use_cache_false_says_so(model):
    hf = copy.deepcopy(model)
    hf.set_attn_implementation("kvpage")
    ids = torch.tensor([[0, 5, 7, 9], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # left padding: the mask reaches the cache
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False .* needs use_cache=True"):
        hf.generate(ids, attention_mask=mask, cache=kvpage.PagedCache(hf.config), use_cache=False,
                    max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # generate's default, use_cache=True, runs on it
        out = hf.generate(ids, attention_mask=mask, cache=kvpage.PagedCache(hf.config),
                          max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 7)
