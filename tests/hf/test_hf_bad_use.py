"""Bad use of a PagedCache raises a clear error naming what is wrong, before anything is computed on it."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvpage import PagedCache
from tiny_models import random_prompts, tiny_config, tiny_model


def kvpage_model(family, **overrides):
    model = tiny_model(family, **overrides)
    model.set_attn_implementation("kvpage")
    return model


def run(model, cache, lengths=(9,), seed=0):
    ids = torch.tensor(random_prompts(lengths, seed=seed))
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                              max_new_tokens=4, pad_token_id=0)


def test_config_must_be_a_config():
    model = kvpage_model("llama")
    with pytest.raises(TypeError, match=r"PretrainedConfig \(pass model.config\)"):
        PagedCache(model)


def test_config_of_another_attention_implementation():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation='kvpage'"):
        PagedCache(model.config)


def test_config_the_kernels_cannot_serve():
    with pytest.raises(ValueError, match="head_dim is 24"):
        PagedCache(LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24, num_hidden_layers=1))


@pytest.mark.parametrize("kwargs,match", [(dict(num_blocks=0), "num_blocks"), (dict(block_size=12), "block_size"),
                                          (dict(dtype="float32"), "dtype")])
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        PagedCache(tiny_config("llama"), **kwargs)


def test_cache_of_another_model_shape():
    """Built for the tiny Llama (2 KV heads of 16) but run on the tiny Qwen2 (2 KV heads of 32)."""
    cache = PagedCache(tiny_config("llama"))
    with pytest.raises(ValueError, match="built for a config with 2 KV heads of size 16"):
        run(kvpage_model("qwen2"), cache)


def test_cache_reused_with_a_deeper_model():
    cache = PagedCache(tiny_config("llama"))
    run(kvpage_model("llama"), cache)
    with pytest.raises(ValueError, match="built for a config with 2 layers"):
        run(kvpage_model("llama", num_hidden_layers=3), cache)


def test_cache_reused_for_another_batch():
    model = kvpage_model("llama")
    cache = PagedCache(model.config)
    run(model, cache, lengths=(9,))
    with pytest.raises(ValueError, match="batch size 2, but the PagedCache holds 1 rows"):
        run(model, cache, lengths=(20, 20))


def test_dtype_mismatch():
    model = kvpage_model("llama")
    with pytest.raises(ValueError, match="holds torch.float16"):
        run(model, PagedCache(model.config, dtype=torch.float16))


def test_out_of_blocks_names_num_blocks():
    model = kvpage_model("llama")
    cache = PagedCache(model.config, num_blocks=2, block_size=8)
    with pytest.raises(RuntimeError, match="num_blocks=2"):
        run(model, cache, lengths=(9, 9))
    assert cache.stats().num_blocks_used == 0  # refused before any block was taken


def test_model_not_on_kvpage_attention():
    """A config claiming "kvpage" while the model runs sdpa: sdpa would see only the new tokens' K/V."""
    model = tiny_model("llama")
    cache = PagedCache(tiny_config("llama"))
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="did not read the PagedCache"):
        run(model, cache)
