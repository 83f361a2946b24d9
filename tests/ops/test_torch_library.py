"""The ops as torch.library ops: schemas and fake kernels (opcheck), and tracing by torch.compile."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference
from paged_data import fused_qkv, generator, int32, randn, random_block_tables, random_kv_cache
from tolerances import assert_attention_close, assert_bit_exact

kvpage_ops = torch.ops.kvpage


def small_step(dtype=torch.float32):
    """A batch of 3 sequences: caches, tables, a decode query and the step's new K/V."""
    gen = generator(11)
    key_cache, value_cache = random_kv_cache(8, 16, 2, 64, dtype, gen)
    seq_lens = int32([5, 17, 40])
    block_tables = random_block_tables(seq_lens.tolist(), 16, 8, gen)
    query, key, value = fused_qkv(3, 4, 2, 64, dtype, gen)
    # Each sequence's newest token goes to its last position, through its own table row.
    slots = torch.tensor([int(block_tables[s, (n - 1) // 16]) * 16 + (n - 1) % 16
                          for s, n in enumerate(seq_lens.tolist())])
    return dict(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables, seq_lens=seq_lens, slot_mapping=slots)


def opcheck_cases():
    s = small_step()
    k, v = s["key_cache"], s["value_cache"]
    query = s["query"].contiguous()
    prefill_query = randn((4, 4, 64), torch.float32, generator(12))
    return {
        "paged_attention": (kvpage_ops.paged_attention.default,
                            (torch.empty_like(query), query, k, v, s["block_tables"], s["seq_lens"], 0.125, 0, True)),
        "paged_prefill_attention": (kvpage_ops.paged_prefill_attention.default,
                                    (torch.empty_like(prefill_query), prefill_query, k, v, s["block_tables"],
                                     int32([0, 1, 1, 4]), s["seq_lens"], 0.125, True)),
        # The optional lse output, which the schema marks as written (Tensor(b!)?).
        "paged_attention_lse": (kvpage_ops.paged_attention.default,
                                (torch.empty_like(query), query, k, v, s["block_tables"], s["seq_lens"], 0.125, 0,
                                 True, 1.0, 1.0, torch.empty(3, 4))),
        "paged_prefill_attention_lse": (kvpage_ops.paged_prefill_attention.default,
                                        (torch.empty_like(prefill_query), prefill_query, k, v, s["block_tables"],
                                         int32([0, 1, 1, 4]), s["seq_lens"], 0.125, True, 1.0, 1.0,
                                         torch.empty(4, 4))),
        "reshape_and_cache": (kvpage_ops.reshape_and_cache.default,
                              (s["key"], s["value"], k, v, s["slot_mapping"], True)),
        "copy_blocks": (kvpage_ops.copy_blocks.default, ([k], [v], torch.tensor([[0, 5], [1, 6]]), True)),
        "swap_blocks": (kvpage_ops.swap_blocks.default,
                        ([k, v], [k.clone()[:4], v.clone()[:4]], torch.tensor([[7, 0], [2, 3]]), True)),
    }


@pytest.mark.parametrize("name", ["paged_attention", "paged_prefill_attention", "paged_attention_lse",
                                  "paged_prefill_attention_lse", "reshape_and_cache", "copy_blocks", "swap_blocks"])
def test_opcheck(name):
    """Schema (mutation annotations match what the kernel writes), fake kernel, autograd
    registration and AOT dispatch, as torch.library checks them."""
    op, args = opcheck_cases()[name]
    torch.library.opcheck(op, args)


def decode_step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens):
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens) * 2.0


def test_compiled_decode_step_matches_eager_and_reference():
    """The model's attention step (write new K/V, then attend) traces as one graph."""
    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    eager, traced = small_step(), small_step()
    expected_out = decode_step(**eager)
    out = compiled(**traced)
    assert_bit_exact(traced["key_cache"], eager["key_cache"])
    assert_bit_exact(traced["value_cache"], eager["value_cache"])
    assert_attention_close(out, expected_out)

    ref = small_step()
    reference.reshape_and_cache(ref["key"], ref["value"], ref["key_cache"], ref["value_cache"], ref["slot_mapping"])
    assert_attention_close(out, 2.0 * reference.paged_attention(ref["query"], ref["key_cache"], ref["value_cache"],
                                                                 ref["block_tables"], ref["seq_lens"]))
