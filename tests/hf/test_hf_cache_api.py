"""The Cache API on kvpage blocks, pass by pass: what rows hold, reorder (block-table permutation with ref
counts), copy-on-write, crop, reset, pool growth; each checked against logits of HF's own attention."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_helpers import blocks_for, left_padded
from kvpage import PagedCache
from tiny_models import random_prompts, tiny_model

BS = 8


@pytest.fixture(scope="module")
def models():
    """(kvpage model, the same weights on sdpa for the reference)."""
    model = tiny_model("llama", seed=3)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    model.set_attn_implementation("kvpage")
    return model, reference


def forward(model, ids, cache, mask=None):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]


def full_logits(reference, token_lists):
    """Last-token logits of each whole sequence, one at a time (no padding, no cache)."""
    with torch.inference_mode():
        return torch.stack([reference(torch.tensor([t])).logits[0, -1] for t in token_lists])


def test_rows_hold_real_tokens_only(models):
    model, reference = models
    prompts = random_prompts([3, 19, 11], seed=2)
    ids, mask = left_padded(prompts, pad_id=0)
    cache = PagedCache(model.config, block_size=BS)
    logits = forward(model, ids, cache, mask)
    torch.testing.assert_close(logits, full_logits(reference, prompts), rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 19 and cache.row_lengths() == [3, 19, 11]
    assert [len(t) for t in cache.block_tables()] == [1, 3, 2]
    assert cache.stats().num_blocks_used == 6  # not 3 rows x 3 blocks


def test_reorder_shares_blocks_then_copies_on_write(models):
    model, reference = models
    prompts = random_prompts([5, 12, 9], seed=4)  # none ends on a block boundary: the next token shares a block
    ids, mask = left_padded(prompts, pad_id=0)
    cache = PagedCache(model.config, block_size=BS)
    forward(model, ids, cache, mask)
    used = cache.stats().num_blocks_used
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    tables = cache.block_tables()
    assert tables[0] == tables[1] and cache.row_lengths() == [12, 12, 5]
    assert all(cache.pool.ref_counts[b] == 2 for b in tables[0])
    assert cache.stats().num_blocks_used == used - blocks_for(9, BS)  # row 2's old blocks went back to the pool
    step = torch.tensor([[7], [8], [9]])
    logits = forward(model, step, cache, torch.cat([mask[[1, 1, 0]], torch.ones(3, 1, dtype=mask.dtype)], 1))
    want = full_logits(reference, [prompts[1] + [7], prompts[1] + [8], prompts[0] + [9]])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    after = cache.block_tables()
    # Row 0 appended to the shared last block first and got a copy; row 1, then alone on it, wrote in place.
    assert cache.stats().num_copy_on_write == 1
    assert after[0][:-1] == after[1][:-1] and after[0][-1] != after[1][-1] == tables[1][-1]


def test_batch_select_and_repeat_interleave(models):
    model, reference = models
    prompts = random_prompts([6, 10], seed=5)
    ids, mask = left_padded(prompts, pad_id=0)
    cache = PagedCache(model.config, block_size=BS)
    forward(model, ids, cache, mask)
    cache.batch_repeat_interleave(2)
    assert cache.row_lengths() == [6, 6, 10, 10] and cache.batch_size == 4
    cache.batch_select_indices(torch.tensor([3, 0]))
    assert cache.row_lengths() == [10, 6]
    assert cache.stats().num_blocks_used == blocks_for(10, BS) + blocks_for(6, BS)
    logits = forward(model, torch.tensor([[3], [4]]), cache, torch.cat([mask[[1, 0]], torch.ones(2, 1).long()], 1))
    torch.testing.assert_close(logits, full_logits(reference, [prompts[1] + [3], prompts[0] + [4]]),
                               rtol=1e-4, atol=1e-4)


def test_crop_frees_blocks_and_rewinds(models):
    model, reference = models
    tokens = random_prompts([21], seed=6)[0]
    cache = PagedCache(model.config, block_size=BS)
    forward(model, torch.tensor([tokens]), cache)
    assert cache.stats().num_blocks_used == 3
    cache.crop(-6)  # 15 tokens left: the third block goes back
    assert cache.get_seq_length() == 15 and cache.row_lengths() == [15] and cache.stats().num_blocks_used == 2
    logits = forward(model, torch.tensor([[5, 6, 7]]), cache)
    torch.testing.assert_close(logits, full_logits(reference, [tokens[:15] + [5, 6, 7]]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="negative integer"):
        cache.crop(4)


def test_crop_inside_padding_counts_real_tokens_only(models):
    model, _ = models
    ids, mask = left_padded(random_prompts([2, 9], seed=8), pad_id=0)
    cache = PagedCache(model.config, block_size=BS)
    forward(model, ids, cache, mask)
    cache.crop(-3)  # 6 columns left: row 0's 7 leading ones were padding
    assert cache.row_lengths() == [0, 6] and cache.block_tables()[0] == []


def test_assisted_decoding_crops_through_hf():
    """HF's assisted generation rolls the main model's cache back with crop() after rejected drafts."""
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=5)
    ids = torch.tensor(random_prompts([13], seed=9))
    model.set_attn_implementation("sdpa")
    reference = model.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=assistant)
    model.set_attn_implementation("kvpage")
    cache = PagedCache(model.config, block_size=BS)
    crops = []
    real_crop = cache.crop
    cache.crop = lambda n: crops.append(n) or real_crop(n)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=assistant, cache=cache)
    assert torch.equal(out, reference)
    assert any(n < 0 for n in crops)


def test_generate_continues_a_cache():
    """A second generate on the returned sequences picks up where the cache stands (only new tokens run)."""
    model = tiny_model("qwen2")
    ids = torch.tensor(random_prompts([10], seed=10))
    model.set_attn_implementation("sdpa")
    reference = model.generate(ids, do_sample=False, max_new_tokens=12)
    model.set_attn_implementation("kvpage")
    cache = PagedCache(model.config, block_size=BS)
    first = model.generate(ids, do_sample=False, max_new_tokens=5, cache=cache)
    assert cache.get_seq_length() == 14
    second = model.generate(first, do_sample=False, max_new_tokens=7, cache=cache)
    assert torch.equal(second, reference)


def test_reset_returns_every_block(models):
    model, _ = models
    ids, mask = left_padded(random_prompts([4, 30], seed=11), pad_id=0)
    cache = PagedCache(model.config, block_size=BS, num_blocks=16)
    forward(model, ids, cache, mask)
    cache.reset()
    assert cache.stats().num_blocks_used == 0 and cache.get_seq_length() == 0 and cache.batch_size == -1
    forward(model, torch.tensor([[1, 2, 3]]), cache)  # a new batch, of another size
    assert cache.row_lengths() == [3]


def test_pool_grows_on_demand_and_fixed_pools_do_not(models):
    model, _ = models
    grown = PagedCache(model.config, block_size=BS)
    fixed = PagedCache(model.config, block_size=BS, num_blocks=40)
    tokens = torch.tensor(random_prompts([100], seed=12))
    for cache in (grown, fixed):
        forward(model, tokens, cache)
        for _ in range(30):
            forward(model, torch.tensor([[5]]), cache)
    assert grown.row_lengths() == fixed.row_lengths() == [130]
    used = blocks_for(130, BS)
    assert grown.stats().num_blocks_used == fixed.stats().num_blocks_used == used
    assert used <= grown.stats().num_blocks_allocated <= 1.25 * used + 1
    assert fixed.stats().num_blocks_allocated == 40
    assert grown.stats().kv_bytes_used == used * grown.bytes_per_block()


class Stop(Exception):
    pass


def test_a_pass_that_stops_midway_is_taken_back(models):
    """An exception or interrupt between two layers (here in layer 0's MLP) leaves layer 1 without this pass's K/V:
    the next call must not attend over them. It raises, the cache goes back to before that pass (block tables and
    ref counts, copy-on-write undone), and the same call then runs."""
    model, reference = models
    prompts = random_prompts([5, 12, 9], seed=4)
    ids, mask = left_padded(prompts, pad_id=0)
    cache = PagedCache(model.config, block_size=BS)
    forward(model, ids, cache, mask)
    cache.reorder_cache(torch.tensor([1, 1, 0]))  # rows 0 and 1 share a partly filled block: the next step copies it
    tables, refs = cache.block_tables(), list(cache.pool.ref_counts)

    def stop(*args):
        raise Stop

    step, mask = torch.tensor([[7], [8], [9]]), torch.cat([mask[[1, 1, 0]], torch.ones(3, 1, dtype=mask.dtype)], 1)
    hook = model.model.layers[0].mlp.register_forward_pre_hook(stop)
    try:
        with pytest.raises(Stop):
            forward(model, step, cache, mask)
    finally:
        hook.remove()
    with pytest.raises(RuntimeError, match="stopped after 1 of its 2 layers"):
        forward(model, step, cache, mask)
    assert cache.block_tables() == tables and cache.pool.ref_counts == refs and cache.get_seq_length() == 12
    logits = forward(model, step, cache, mask)
    want = full_logits(reference, [prompts[1] + [7], prompts[1] + [8], prompts[0] + [9]])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_an_error_at_a_later_layer_leaves_the_cache_as_it_was():
    """Layer 1 refuses the pass (it claims to attend bidirectionally) after layer 0 has written its K/V."""
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    model.set_attn_implementation("kvpage")
    tokens = random_prompts([6], seed=13)[0]
    cache = PagedCache(model.config, block_size=4)
    forward(model, torch.tensor([tokens]), cache)
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(NotImplementedError, match="causal only"):
        forward(model, torch.tensor([[5, 6, 7]]), cache)
    model.model.layers[1].self_attn.is_causal = True
    assert cache.row_lengths() == [6] and cache.stats().num_blocks_used == 2
    logits = forward(model, torch.tensor([[9]]), cache)
    torch.testing.assert_close(logits, full_logits(reference, [tokens + [9]]), rtol=1e-4, atol=1e-4)
