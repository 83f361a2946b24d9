"""Bad input: every op raises ValueError / TypeError naming the argument, and leaves the caches as
they were (checks run before any write). Each case changes one argument of a valid call."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvpage import ops
from paged_data import generator, int32, randn, random_kv_cache, snapshot
from tolerances import assert_bit_exact

F32, I32, I64 = torch.float32, torch.int32, torch.int64


def case(case_id, error, match, **changes):
    """One bad call: changes maps an argument to a value, or to a function of the valid arguments."""
    return pytest.param(changes, error, match, id=case_id)


def with_changes(args, changes):
    return {**args, **{name: value(args) if callable(value) else value for name, value in changes.items()}}


def tensors_in(*values):
    """The tensors among values and lists of values (some cases replace a cache with junk)."""
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [v for v in flat if isinstance(v, torch.Tensor)]


def assert_rejected(op, args, error, match, watched):
    """op(**args) raises error matching match, and no CPU tensor among watched changed."""
    watched = [t for t in tensors_in(*watched) if t.device.type == "cpu"]
    before = snapshot(*watched)
    with pytest.raises(error, match=match):
        op(**args)
    for tensor, old in zip(watched, before):
        assert_bit_exact(tensor, old)


def strided_last_dim(t):
    """Same shape and values, but the last dimension has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def replaced(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def transposed_blocks(cache):
    """The cache's shape and values with the (block_size, head_size) tile stored transposed."""
    return cache.transpose(2, 3).contiguous().transpose(2, 3)


def cache_like(cache, block_size=None, head_size=None, dims=4):
    num_blocks, heads, bs, d = cache.shape
    return torch.zeros((num_blocks, heads, block_size or bs, head_size or d)[:dims], dtype=cache.dtype)


# -- paged_attention -----------------------------------------------------------------------------------


def decode_args():
    """Valid: 2 sequences of 40 and 17 tokens, 4 query / 2 KV heads of 64, 16-token blocks, 6 blocks."""
    gen = generator(0)
    key_cache, value_cache = random_kv_cache(6, 16, 2, 64, F32, gen)
    return dict(query=randn((2, 4, 64), F32, gen), key_cache=key_cache, value_cache=value_cache,
                block_tables=int32([[0, 1, 2], [3, 3, 5]]), seq_lens=int32([40, 17]))


# Errors paged_attention and paged_prefill_attention share (the same query / cache / table checks).
ATTENTION_ERRORS = [
    case("query-dtype-differs", TypeError, "query dtype", query=lambda a: a["query"].half()),
    case("int-caches", TypeError, "key_cache dtype", key_cache=lambda a: a["key_cache"].int(),
         value_cache=lambda a: a["value_cache"].int()),
    case("value-cache-dtype-differs", TypeError, "value_cache dtype", value_cache=lambda a: a["value_cache"].half()),
    case("float-block-tables", TypeError, "block_tables", block_tables=lambda a: a["block_tables"].float()),
    case("int64-block-tables", TypeError, "block_tables", block_tables=lambda a: a["block_tables"].long()),
    case("int64-seq-lens", TypeError, "seq_lens", seq_lens=lambda a: a["seq_lens"].long()),
    case("float-seq-lens", TypeError, "seq_lens", seq_lens=lambda a: a["seq_lens"].float()),
    case("query-2d", ValueError, "query", query=lambda a: a["query"][0]),
    case("query-head-size", ValueError, "query head_size", query=lambda a: a["query"][..., :32]),
    case("heads-do-not-divide", ValueError, "num_heads", query=lambda a: a["query"][:, :3]),
    case("query-last-dim-strided", ValueError, "query must be contiguous",
         query=lambda a: strided_last_dim(a["query"])),
    case("key-cache-not-contiguous", ValueError, "key_cache must be contiguous",
         key_cache=lambda a: transposed_blocks(a["key_cache"])),
    case("value-cache-not-contiguous", ValueError, "value_cache must be contiguous",
         value_cache=lambda a: transposed_blocks(a["value_cache"])),
    case("cache-3d", ValueError, "key_cache", key_cache=lambda a: cache_like(a["key_cache"], dims=3),
         value_cache=lambda a: cache_like(a["value_cache"], dims=3)),
    case("value-cache-shape-differs", ValueError, "value_cache shape",
         value_cache=lambda a: a["value_cache"][:5]),
    case("cache-block-size-not-power-of-two", ValueError, "block_size",
         key_cache=lambda a: cache_like(a["key_cache"], block_size=12),
         value_cache=lambda a: cache_like(a["value_cache"], block_size=12)),
    case("cache-head-size-not-multiple-of-16", ValueError, "head_size",
         key_cache=lambda a: cache_like(a["key_cache"], head_size=72),
         value_cache=lambda a: cache_like(a["value_cache"], head_size=72)),
    case("block-tables-1d", ValueError, "block_tables", block_tables=lambda a: a["block_tables"][0]),
    case("block-tables-not-contiguous", ValueError, "block_tables must be contiguous",
         block_tables=lambda a: a["block_tables"].repeat(1, 2)[:, ::2]),
    case("seq-lens-2d", ValueError, "seq_lens", seq_lens=lambda a: a["seq_lens"][None]),
    case("table-rows-differ-from-seq-lens", ValueError, "block_tables has",
         block_tables=lambda a: a["block_tables"][:1]),
    # A row holds 3 blocks of 16 tokens: 49 is one too many.
    case("seq-len-beyond-table-row", ValueError, r"seq_lens\[1\]", seq_lens=lambda a: replaced(a["seq_lens"], 1, 49)),
    case("negative-seq-len", ValueError, r"seq_lens\[0\]", seq_lens=lambda a: replaced(a["seq_lens"], 0, -1)),
    case("block-id-past-cache", ValueError, r"block_tables\[1, 0\]",
         block_tables=lambda a: replaced(a["block_tables"], (1, 0), 6)),
    case("negative-block-id", ValueError, r"block_tables\[0, 0\]",
         block_tables=lambda a: replaced(a["block_tables"], (0, 0), -1)),
    case("out-shape", ValueError, "out shape", out=lambda a: a["query"][..., :32].clone()),
    case("out-dtype", TypeError, "out dtype", out=lambda a: torch.empty_like(a["query"], dtype=torch.float16)),
    case("out-last-dim-strided", ValueError, "out must be contiguous",
         out=lambda a: strided_last_dim(torch.empty_like(a["query"]))),
    case("scale-not-a-number", TypeError, "scale", scale="0.1"),
    case("scale-bool", TypeError, "scale", scale=True),
    case("query-not-a-tensor", TypeError, "query", query=lambda a: a["query"].tolist()),
    case("key-cache-numpy", TypeError, "key_cache", key_cache=lambda a: a["key_cache"].numpy()),
    case("value-cache-none", TypeError, "value_cache", value_cache=None),
    case("block-tables-list", TypeError, "block_tables", block_tables=[[0, 1, 2], [3, 3, 5]]),
    case("seq-lens-list", TypeError, "seq_lens", seq_lens=[40, 17]),
    case("out-list", TypeError, "out", out=[0.0]),
    case("scale-nan", ValueError, "scale", scale=float("nan")),
    case("scale-inf", ValueError, "scale", scale=float("-inf")),
    case("scale-beyond-float32", ValueError, "scale", scale=1e300),
    case("scale-beyond-float", ValueError, "scale", scale=2**1100),
    case("out-expanded", ValueError, "out has elements that share memory",
         out=lambda a: torch.empty_like(a["query"][:1]).expand_as(a["query"])),
    case("out-inside-key-cache", ValueError, "out and key_cache share memory",
         out=lambda a: a["key_cache"].view(-1)[: a["query"].numel()].view(a["query"].shape)),
    case("out-inside-value-cache", ValueError, "out and value_cache share memory",
         out=lambda a: a["value_cache"].view(-1)[: a["query"].numel()].view(a["query"].shape)),
]

DECODE_ERRORS = ATTENTION_ERRORS + [
    case("zero-seq-len", ValueError, r"seq_lens\[1\] = 0", seq_lens=int32([40, 0])),
    case("query-tokens-differ-from-seqs", ValueError, "query has 3 tokens",
         query=lambda a: torch.cat([a["query"], a["query"][:1]])),
    case("partition-not-multiple-of-block", ValueError, "partition_size", partition_size=24),
    case("partition-zero", ValueError, "partition_size", partition_size=0),
    case("partition-negative", ValueError, "partition_size", partition_size=-16),
    case("partition-float", ValueError, "partition_size", partition_size=32.0),
    case("partition-bool", ValueError, "partition_size", partition_size=True),
]


# -- paged_prefill_attention -----------------------------------------------------------------------


def prefill_args():
    """Valid: q_lens 3, 0, 2 after contexts 5, 16, 0; the decode cache and tables."""
    args = decode_args()
    args.update(query=randn((5, 4, 64), F32, generator(1)), query_start_loc=int32([0, 3, 3, 5]),
                seq_lens=int32([8, 16, 2]), block_tables=int32([[0, 1, 2], [3, 3, 5], [4, 0, 0]]))
    return args


PREFILL_ERRORS = ATTENTION_ERRORS + [
    case("query-start-loc-length", ValueError, "query_start_loc must have", query_start_loc=int32([0, 3, 5])),
    case("query-start-loc-not-from-zero", ValueError, r"query_start_loc\[0\]", query_start_loc=int32([1, 3, 3, 5])),
    case("query-start-loc-decreasing", ValueError, "query_start_loc must be non-decreasing",
         query_start_loc=int32([0, 3, 2, 5])),
    case("query-start-loc-last-not-num-tokens", ValueError, r"query_start_loc\[-1\]",
         query_start_loc=int32([0, 3, 3, 4])),
    case("q-len-beyond-seq-len", ValueError, r"seq_lens\[0\] = 2 is shorter", seq_lens=int32([2, 16, 2])),
    case("int64-query-start-loc", TypeError, "query_start_loc", query_start_loc=lambda a: a["query_start_loc"].long()),
    case("query-start-loc-2d", ValueError, "query_start_loc", query_start_loc=lambda a: a["query_start_loc"][None]),
    case("query-start-loc-list", TypeError, "query_start_loc", query_start_loc=[0, 3, 3, 5]),
]


# -- reshape_and_cache -------------------------------------------------------------------------------


def cache_write_args():
    """Valid: 4 tokens of 2 KV heads x 64 into 6 blocks of 16 (96 slots); the last slot is 95."""
    gen = generator(2)
    key_cache, value_cache = random_kv_cache(6, 16, 2, 64, F32, gen)
    return dict(key=randn((4, 2, 64), F32, gen), value=randn((4, 2, 64), F32, gen), key_cache=key_cache,
                value_cache=value_cache, slot_mapping=torch.tensor([0, 17, -1, 95]))


RESHAPE_AND_CACHE_ERRORS = [
    case("key-dtype", TypeError, "key dtype", key=lambda a: a["key"].half()),
    case("value-dtype", TypeError, "value dtype", value=lambda a: a["value"].bfloat16()),
    case("key-heads", ValueError, "key must be", key=lambda a: a["key"].repeat(1, 2, 1)),
    case("key-head-size", ValueError, "key must be", key=lambda a: a["key"][..., :32]),
    case("key-2d", ValueError, "key must be", key=lambda a: a["key"][0]),
    case("value-tokens", ValueError, "value has 3 tokens", value=lambda a: a["value"][:3]),
    case("key-last-dim-strided", ValueError, "key must be contiguous", key=lambda a: strided_last_dim(a["key"])),
    case("int-caches", TypeError, "key_cache dtype", key_cache=lambda a: a["key_cache"].int(),
         value_cache=lambda a: a["value_cache"].int()),
    case("cache-not-contiguous", ValueError, "key_cache must be contiguous",
         key_cache=lambda a: transposed_blocks(a["key_cache"])),
    case("int32-slot-mapping", TypeError, "slot_mapping", slot_mapping=lambda a: a["slot_mapping"].int()),
    case("float-slot-mapping", TypeError, "slot_mapping", slot_mapping=lambda a: a["slot_mapping"].float()),
    case("slot-mapping-2d", ValueError, "slot_mapping", slot_mapping=lambda a: a["slot_mapping"][None]),
    case("slot-mapping-length", ValueError, "slot_mapping has 3 entries", slot_mapping=torch.tensor([0, 1, 2])),
    case("slot-mapping-not-contiguous", ValueError, "slot_mapping must be contiguous",
         slot_mapping=lambda a: a["slot_mapping"].repeat_interleave(2)[::2]),
    # Valid slots come first: a write of those before the check would show in the caches.
    case("slot-past-cache", ValueError, r"slot_mapping\[3\] = 96", slot_mapping=torch.tensor([0, 17, -1, 96])),
    case("slot-below-minus-one", ValueError, r"slot_mapping\[3\] = -2", slot_mapping=torch.tensor([0, 17, -1, -2])),
    case("slot-mapping-list", TypeError, "slot_mapping", slot_mapping=[0, 17, -1, 95]),
    case("slot-written-twice", ValueError, r"slot_mapping\[1\] and slot_mapping\[3\] both write slot 17",
         slot_mapping=torch.tensor([0, 17, -1, 17])),
    case("key-not-a-tensor", TypeError, "key", key=lambda a: a["key"].tolist()),
    case("value-cache-is-key-cache", ValueError, "key_cache and value_cache share memory",
         value_cache=lambda a: a["key_cache"]),
    case("key-inside-key-cache", ValueError, "key and key_cache share memory",
         key=lambda a: a["key_cache"].view(-1)[: a["key"].numel()].view(a["key"].shape)),
    case("value-inside-value-cache", ValueError, "value and value_cache share memory",
         value=lambda a: a["value_cache"].view(-1)[: a["value"].numel()].view(a["value"].shape)),
]


# -- copy_blocks -----------------------------------------------------------------------------------------


def copy_args():
    """Valid: two layers of 6 blocks each."""
    gen = generator(3)
    layers = [random_kv_cache(6, 8, 2, 32, F32, gen) for _ in range(2)]
    return dict(key_caches=[k for k, _ in layers], value_caches=[v for _, v in layers],
                block_mapping=torch.tensor([[0, 1], [0, 2]]))


def mapping(*pairs, dtype=I64):
    return torch.tensor(pairs, dtype=dtype)


# Bad pairs come after a valid one: a copy before the check would show in the caches.
BLOCK_MAPPING_ERRORS = [
    case("duplicate-destination", ValueError, "block_mapping writes destination block 3 twice",
         block_mapping=mapping([0, 3], [1, 3])),
    case("source-past-cache", ValueError, r"block_mapping\[1\] source", block_mapping=mapping([0, 1], [6, 2])),
    case("destination-past-cache", ValueError, r"block_mapping\[1\] destination",
         block_mapping=mapping([0, 1], [2, 6])),
    case("negative-source", ValueError, r"block_mapping\[1\] source", block_mapping=mapping([0, 1], [-1, 2])),
    case("float-block-mapping", TypeError, "block_mapping", block_mapping=mapping([0, 1], dtype=F32)),
    case("int32-block-mapping", TypeError, "block_mapping", block_mapping=mapping([0, 1], dtype=I32)),
    case("block-mapping-triples", ValueError, "block_mapping must be", block_mapping=mapping([0, 1, 2])),
    case("block-mapping-1d", ValueError, "block_mapping must be", block_mapping=torch.tensor([0, 1])),
    case("block-mapping-not-a-sequence", TypeError, "block_mapping", block_mapping=5),
    case("float-block-ids-in-list", TypeError, r"block_mapping\[1\] holds 2.5", block_mapping=[[0, 1], [2.5, 3]]),
    case("bool-block-ids-in-list", TypeError, r"block_mapping\[1\] holds True", block_mapping=[[0, 1], [True, 3]]),
    case("ragged-list", ValueError, r"block_mapping\[1\] must be a \(src, dst\) pair", block_mapping=[[0, 1], [2]]),
    case("str-block-ids-in-list", TypeError, r"block_mapping\[0\] holds str", block_mapping=[["0", "1"]]),
    case("block-mapping-str", TypeError, "block_mapping", block_mapping="01"),
]

COPY_BLOCKS_ERRORS = BLOCK_MAPPING_ERRORS + [
    case("source-also-destination", ValueError, "block_mapping reads block 3",
         block_mapping=mapping([0, 3], [3, 4])),
    case("layer-counts-differ", ValueError, "value_caches", value_caches=lambda a: a["value_caches"][:1]),
    case("layer-shapes-differ", ValueError, r"key_caches\[1\]",
         key_caches=lambda a: [a["key_caches"][0], a["key_caches"][1][:5]],
         value_caches=lambda a: [a["value_caches"][0], a["value_caches"][1][:5]]),
    case("int-caches", TypeError, "key_cache dtype", key_caches=lambda a: [k.int() for k in a["key_caches"]],
         value_caches=lambda a: [v.int() for v in a["value_caches"]]),
    case("layer-not-a-tensor", TypeError, r"key_caches\[1\]", key_caches=lambda a: [a["key_caches"][0], "x"]),
    case("key-caches-not-a-list", TypeError, "key_caches", key_caches=5),
    case("value-caches-are-key-caches", ValueError, r"key_caches\[0\] and value_caches\[0\] share memory",
         value_caches=lambda a: a["key_caches"]),
]


# -- swap_blocks -----------------------------------------------------------------------------------------


def swap_args():
    """Valid: K and V of one layer, 6 device blocks -> 6 host blocks."""
    src, dst = copy_args()["key_caches"], copy_args()["value_caches"]
    return dict(src=src, dst=dst, block_mapping=mapping([0, 1], [0, 2]))


SWAP_BLOCKS_ERRORS = BLOCK_MAPPING_ERRORS + [
    case("block-shapes-differ", ValueError, r"src\[1\]", dst=lambda a: [a["dst"][0], a["dst"][1][:, :, :4]]),
    case("tensor-counts-differ", ValueError, "dst", dst=lambda a: a["dst"][:1]),
    case("dtypes-differ", TypeError, r"dst\[0\] dtype", dst=lambda a: [t.half() for t in a["dst"]]),
    case("dst-not-contiguous", ValueError, r"dst\[0\] must be contiguous",
         dst=lambda a: [transposed_blocks(t) for t in a["dst"]]),
    case("src-1d", ValueError, r"src\[0\]", src=lambda a: [t.flatten() for t in a["src"]],
         dst=lambda a: [t.flatten() for t in a["dst"]]),
    case("src-not-a-tensor", TypeError, "src", src=3.0),
    case("dst-is-src", ValueError, r"src\[0\] and dst\[0\] share memory", dst=lambda a: a["src"]),
    case("dst-crosses-src", ValueError, r"src\[1\] and dst\[0\] share memory",
         dst=lambda a: [a["src"][1], a["dst"][1]]),
    case("dst-twice", ValueError, r"dst\[0\] and dst\[1\] share memory", dst=lambda a: [a["dst"][0], a["dst"][0]]),
]


def op_cases(op, make_args, cases):
    return [pytest.param(op, make_args, *c.values, id=f"{op.__name__}-{c.id}") for c in cases]


@pytest.mark.parametrize("op, make_args, changes, error, match",
                         op_cases(ops.paged_attention, decode_args, DECODE_ERRORS)
                         + op_cases(ops.paged_prefill_attention, prefill_args, PREFILL_ERRORS)
                         + op_cases(ops.reshape_and_cache, cache_write_args, RESHAPE_AND_CACHE_ERRORS)
                         + op_cases(ops.copy_blocks, copy_args, COPY_BLOCKS_ERRORS)
                         + op_cases(ops.swap_blocks, swap_args, SWAP_BLOCKS_ERRORS))
def test_bad_input_is_rejected(op, make_args, changes, error, match):
    args = with_changes(make_args(), changes)
    assert_rejected(op, args, error, match, list(args.values()))


# -- aliasing ------------------------------------------------------------------------------------------


def index_inside(t, values, dtype):
    """A tensor of values (dtype) stored in t's own memory, at its start."""
    view = t.reshape(-1).view(dtype)[: len(values)]
    view.copy_(torch.tensor(values, dtype=dtype))
    return view


# (op, valid arguments, the index argument, the written tensor it is placed in, where in it): each
# index tensor is read while the op writes, so one inside a written tensor would be overwritten
# mid-call and then used as offsets. The places are ones the valid call does not itself write.
INDEX_INSIDE_WRITTEN = [
    (ops.reshape_and_cache, cache_write_args, "slot_mapping", "key_cache", lambda t: t[3]),
    (ops.reshape_and_cache, cache_write_args, "slot_mapping", "value_cache", lambda t: t[3]),
    (ops.paged_prefill_attention, prefill_args, "query_start_loc", "out", lambda t: t),
    (ops.copy_blocks, copy_args, "block_mapping", "key_caches", lambda t: t[1][5]),
    (ops.copy_blocks, copy_args, "block_mapping", "value_caches", lambda t: t[0][5]),
    (ops.swap_blocks, swap_args, "block_mapping", "dst", lambda t: t[1][5]),
]


@pytest.mark.parametrize("op, make_args, name, inside, where", INDEX_INSIDE_WRITTEN,
                         ids=[f"{c[0].__name__}-{c[2]}-in-{c[3]}" for c in INDEX_INSIDE_WRITTEN])
def test_index_tensors_must_not_lie_in_what_the_op_writes(op, make_args, name, inside, where):
    args = make_args()
    if inside == "out":
        args["out"] = torch.empty_like(args["query"])
    values = args[name]
    args[name] = index_inside(where(args[inside]), values.flatten().tolist(), values.dtype).view(values.shape)
    assert_rejected(op, args, ValueError, rf"(?=.*{name})(?=.*{inside}).*share memory", list(args.values()))


def test_a_bad_kvpage_cpu_isa_raises_in_ops_until_set_cpu_isa_picks_one():
    code = (
        "import pytest, torch\n"
        "from kvpage import ops\n"
        "with pytest.raises(RuntimeError, match='KVPAGE_CPU_ISA=sse9 is not available'):\n"
        "    ops.cpu_isa()\n"
        "ops.set_cpu_isa('generic')\n"
        "assert ops.cpu_isa() == 'generic'\n"
        "k, v = ops.allocate_kv_cache(2, 16, 1, 64)\n"
        "q = torch.randn(1, 2, 64)\n"
        "out = ops.paged_attention(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))\n"
        "ref = ops.reference.paged_attention(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))\n"
        "torch.testing.assert_close(out, ref)\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVPAGE_CPU_ISA": "sse9"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("op, make_args", [(ops.paged_attention, decode_args),
                                           (ops.paged_prefill_attention, prefill_args)], ids=["decode", "prefill"])
def test_out_may_be_query_itself_but_not_overlap_it_partly(op, make_args):
    args = make_args()
    expected = op(**args)
    buffer = torch.cat([args["query"].flatten(), torch.zeros(64)])
    shape = args["query"].shape
    query, shifted_out = buffer[64:].view(shape), buffer[:-64].view(shape)
    assert_rejected(op, {**args, "query": query, "out": shifted_out}, ValueError, "out partly overlaps query",
                    [args["key_cache"], args["value_cache"], buffer])
    query = args["query"].clone()
    assert op(**{**args, "query": query, "out": query}) is query
    assert_bit_exact(query, expected)


def test_meta_tensors_mixed_with_real_ones_are_rejected():
    # A call with any meta tensor computes nothing: the real dst would silently keep its blocks.
    args = swap_args()
    meta_src = [t.to("meta") for t in args["src"]]
    assert_rejected(ops.swap_blocks, {**args, "src": meta_src}, ValueError, r"src\[0\] is a meta tensor",
                    args["dst"])
    ops.swap_blocks(meta_src, [t.to("meta") for t in args["dst"]], args["block_mapping"])  # all meta: fine


# -- device mismatch -----------------------------------------------------------------------------------
# This machine has no second real device, so the tensor out of place lives on 'meta'.


def on_meta(name, *more):
    """Changes that move the named arguments (a tensor, or the last tensor of a list) to 'meta'."""
    def move(value):
        return value[:-1] + [value[-1].to("meta")] if isinstance(value, list) else value.to("meta")
    return {n: (lambda a, n=n: move(a[n])) for n in (name, *more)}


MISPLACED = [
    pytest.param(ops.paged_attention, decode_args, on_meta("query"), "query", id="decode-query"),
    pytest.param(ops.paged_attention, decode_args, on_meta("value_cache"), "value_cache", id="decode-value-cache"),
    pytest.param(ops.paged_attention, decode_args, on_meta("block_tables"), "block_tables", id="decode-block-tables"),
    pytest.param(ops.paged_attention, decode_args, on_meta("seq_lens"), "seq_lens", id="decode-seq-lens"),
    pytest.param(ops.paged_prefill_attention, prefill_args, on_meta("query_start_loc"), "query_start_loc",
                 id="prefill-query-start-loc"),
    pytest.param(ops.reshape_and_cache, cache_write_args, on_meta("key"), "key", id="cache-write-key"),
    pytest.param(ops.reshape_and_cache, cache_write_args, on_meta("slot_mapping"), "slot_mapping",
                 id="cache-write-slot-mapping"),
    pytest.param(ops.copy_blocks, copy_args, on_meta("key_caches", "value_caches"), "key_caches", id="copy-layer"),
    pytest.param(ops.copy_blocks, copy_args, on_meta("block_mapping"), "block_mapping", id="copy-block-mapping"),
    pytest.param(ops.swap_blocks, swap_args, on_meta("dst"), "dst", id="swap-dst"),
]


@pytest.mark.parametrize("op, make_args, changes, name", MISPLACED)
def test_tensor_on_another_device_is_rejected(op, make_args, changes, name):
    # A 'meta' tensor sends the call to the fake kernels, not the C++ ones: they must check too.
    args = with_changes(make_args(), changes)
    assert_rejected(op, args, ValueError, name, list(args.values()))


def raw_op_args(op, a):
    """The schema's positional arguments (torch.ops.kvpage.*) for a public-face argument dict."""
    return {
        ops.paged_attention: lambda: (torch.empty(a["query"].shape), a["query"], a["key_cache"], a["value_cache"],
                                      a["block_tables"], a["seq_lens"], 0.125, 0, True),
        ops.paged_prefill_attention: lambda: (torch.empty(a["query"].shape), a["query"], a["key_cache"],
                                              a["value_cache"], a["block_tables"], a["query_start_loc"],
                                              a["seq_lens"], 0.125, True),
        ops.reshape_and_cache: lambda: (a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"],
                                        True),
        ops.copy_blocks: lambda: (a["key_caches"], a["value_caches"], a["block_mapping"], True),
        ops.swap_blocks: lambda: (a["src"], a["dst"], a["block_mapping"], True),
    }[op]()


@pytest.mark.parametrize("op, make_args, changes, name", MISPLACED)
def test_cpu_kernel_rejects_tensors_on_another_device(op, make_args, changes, name):
    """The C++ device checks themselves, reached by sending the call straight to the CPU kernel."""
    args = with_changes(make_args(), changes)
    overload = getattr(torch.ops.kvpage, op.__name__).default
    with pytest.raises(ValueError, match=name):
        overload.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *raw_op_args(op, args))


# -- allocate_kv_cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param(dict(block_size=bs), ValueError, "block_size", id=f"block-size-{bs}") for bs in (3, 12, 512, 0)
] + [
    pytest.param(dict(head_size=d), ValueError, "head_size", id=f"head-size-{d}") for d in (72, 272, 8, 0)
] + [
    pytest.param(dict(num_blocks=0), ValueError, "num_blocks", id="no-blocks"),
    pytest.param(dict(num_blocks=-1), ValueError, "num_blocks", id="negative-blocks"),
    pytest.param(dict(num_kv_heads=0), ValueError, "num_kv_heads", id="no-heads"),
    pytest.param(dict(num_blocks=2.0), TypeError, "num_blocks", id="float-blocks"),
    pytest.param(dict(num_blocks="4"), TypeError, "num_blocks", id="str-blocks"),
    pytest.param(dict(block_size=True), TypeError, "block_size", id="bool-block-size"),
    pytest.param(dict(head_size=np.int64(64)), TypeError, "head_size", id="numpy-head-size"),
    pytest.param(dict(num_kv_heads=None), TypeError, "num_kv_heads", id="none-heads"),
    pytest.param(dict(dtype=torch.int32), TypeError, "dtype", id="int-dtype"),
    pytest.param(dict(dtype=torch.float64), TypeError, "dtype", id="float64-dtype"),
    pytest.param(dict(dtype="float32"), TypeError, "dtype", id="str-dtype"),
    pytest.param(dict(device="meta", pin_memory=True), ValueError, "pin_memory=True needs device 'cpu'",
                 id="pinned-off-host"),
    # No CUDA here, or no 100th GPU there: torch's assertion or error, named.
    pytest.param(dict(device="cuda:99"), RuntimeError, "device 'cuda:99'", id="unavailable-device"),
    # 1.2 TB: past any machine's free memory, where Linux would OOM-kill the zero-fill instead of failing.
    pytest.param(dict(num_blocks=10**7, num_kv_heads=8, head_size=128), RuntimeError, "num_blocks=10000000 needs",
                 id="beyond-free-memory"),
])
def test_allocate_kv_cache_rejects(kwargs, error, match):
    args = {**dict(num_blocks=4, block_size=16, num_kv_heads=2, head_size=64), **kwargs}
    with pytest.raises(error, match=match):
        ops.allocate_kv_cache(**args)


def test_allocate_kv_cache_pinned_where_there_is_a_gpu_else_named_refusal():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="allocate_kv_cache: .*pin_memory"):
            ops.allocate_kv_cache(4, 16, 2, 64, pin_memory=True)
        return
    caches = ops.allocate_kv_cache(4, 16, 2, 64, pin_memory=True)
    assert all(c.is_pinned() and c.device.type == "cpu" and not c.any() for c in caches)


def test_allocate_kv_cache_checks_what_is_free_now(monkeypatch):
    """The limit is the memory free at the call (MemAvailable, a cgroup's limit), not a constant."""
    from kvpage.ops import memory

    need = 2 * 64 * 2 * 16 * 64 * 4  # K and V of 64 blocks
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    with pytest.raises(RuntimeError, match="only 0.00 GiB of memory is available"):
        ops.allocate_kv_cache(64, 16, 2, 64)
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    assert ops.allocate_kv_cache(64, 16, 2, 64)[0].shape == (64, 2, 16, 64)


def test_cpu_isa_switch_rejects_unknown_isa():
    previous = ops.cpu_isa()
    with pytest.raises(ValueError, match="isa 'sse9' is not available"):
        ops.set_cpu_isa("sse9")
    assert ops.cpu_isa() == previous
    for isa in ops.available_cpu_isas():
        ops.set_cpu_isa(isa)
        assert ops.cpu_isa() == isa
    ops.set_cpu_isa(previous)
