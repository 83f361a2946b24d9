"""Bad use of a PagedCache raises a clear error naming what is wrong, before anything is computed on it."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_helpers import left_padded
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
                                          (dict(dtype="float32"), "dtype"),
                                          # past int32 block ids; past any machine's memory (2 PB of K/V)
                                          (dict(num_blocks=2**31), "num_blocks"),
                                          (dict(num_blocks=2**31 - 1, block_size=256), "num_blocks=2147483647 needs")])
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


def forward(model, cache, ids, mask=None):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, cache=cache).logits


@pytest.mark.parametrize("mask", [torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1]), torch.ones(1, 9, 9).tril().long()],
                         ids=["1d", "3d"])
def test_mask_that_is_not_2d_is_refused_not_ignored(mask):
    model = kvpage_model("llama")
    cache = PagedCache(model.config)
    with pytest.raises(ValueError, match=r"attention_mask has shape .* expects \(1, 9\)"):
        forward(model, cache, torch.tensor(random_prompts([9])), mask)


@pytest.mark.parametrize("method,indices,error,match", [
    ("reorder_cache", torch.tensor([True, False, True]), ValueError, "beam_idx must be a 1-D integer tensor"),
    ("reorder_cache", torch.tensor([0, -1, 1]), ValueError, r"beam_idx holds \[-1\], out of range"),
    ("reorder_cache", [0.7, 1.2, 1.9], TypeError, "beam_idx must be"),
    ("reorder_cache", None, TypeError, "beam_idx must be"),
    ("batch_select_indices", torch.tensor([True, False, True]), ValueError, "indices must be"),
    ("batch_select_indices", [5], ValueError, r"indices holds \[5\], out of range for the cache's 3 rows"),
])
def test_bad_row_indices(method, indices, error, match):
    """A bool mask is not indices (torch's index_select refuses it too), floats are not truncated."""
    model = kvpage_model("llama")
    cache = PagedCache(model.config, block_size=8)
    forward(model, cache, *left_padded(random_prompts([5, 12, 9]), pad_id=0))
    with pytest.raises(error, match=match):
        getattr(cache, method)(indices)
    assert cache.row_lengths() == [5, 12, 9]


@pytest.mark.parametrize("count", [-1.5, None, "2"])
def test_crop_needs_an_int(count):
    with pytest.raises(TypeError, match="tokens_to_remove must be an int"):
        PagedCache(tiny_config("llama")).crop(count)


def test_device_must_be_a_device():
    with pytest.raises(ValueError, match="device must be"):
        PagedCache(tiny_config("llama"), device="nope")


def test_a_rejected_layer_leaves_the_cache_usable():
    model = kvpage_model("llama", attention_dropout=0.1)
    cache = PagedCache(model.config)
    model.train()
    with pytest.raises(ValueError, match="dropout must be 0"):
        run(model, cache)
    model.eval()
    run(model, cache)  # the same cache, now that the model is right


def test_backward_through_kvpage_attention_raises():
    """The kernels have no backward: a gradient that skipped the attention would be silently wrong."""
    model = kvpage_model("llama")
    logits = model(input_ids=torch.tensor(random_prompts([6])), cache=PagedCache(model.config)).logits
    with pytest.raises(RuntimeError, match="no backward pass"):
        logits.sum().backward()
