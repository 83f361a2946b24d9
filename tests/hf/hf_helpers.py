"""Run HF generate twice on the same weights: the reference (sdpa attention, HF's DynamicCache) and
kvpage (kvpage attention, PagedCache), with the same seed, so any difference is the cache's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvpage import PagedCache


@dataclass
class Pair:
    reference: object  # what generate returned on DynamicCache
    paged: object  # ... on PagedCache
    cache: PagedCache


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of a left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate_both(model, input_ids, attention_mask, seed: int = 0, cache_kwargs: dict | None = None,
                  reference_attention: str = "sdpa", **generate_kwargs) -> Pair:
    """reference_attention: "eager" for models whose attention sdpa cannot compute (Gemma 2's softcap,
    gpt-oss's sinks)."""
    model.set_attn_implementation(reference_attention)
    torch.manual_seed(seed)
    with torch.inference_mode():
        reference = model.generate(input_ids, attention_mask=attention_mask,
                                   cache=DynamicCache(config=model.config), **generate_kwargs)
    model.set_attn_implementation("kvpage")
    cache = PagedCache(model.config, **(cache_kwargs or {}))
    torch.manual_seed(seed)
    with torch.inference_mode():
        paged = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **generate_kwargs)
    return Pair(reference, paged, cache)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
