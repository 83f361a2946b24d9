"""kvpage::llama_decoder_layer, the lean CPU layers' one op per decoder layer: the layer's formula from
ops/reference.py (RMSNorm, q/k/v, rotary, cache write, causal attention over the cache, o_proj and
residual, RMSNorm, gate/up, SiLU, down and residual) on decode and prefill steps, biases or none,
every CPU ISA; the cache written as reshape_and_cache writes it; bad arguments named."""
import math

import pytest
import torch

from kvpage import ops
from kvpage.ops import reference
from kvpage.ops._library import ops as library_ops
from kvpage.ops.layers import pack_linear_weight

HIDDEN, HEADS, KV_HEADS, D, INTERMEDIATE, BLOCK = 96, 6, 2, 16, 160, 8
EPS = (1e-5, 1e-6)


def _layer(bias: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.1
    q, kv = HEADS * D, KV_HEADS * D
    return {"in_norm": 1 + w(HIDDEN), "post_norm": 1 + w(HIDDEN), "qkv": w(q + 2 * kv, HIDDEN),
            "o": w(HIDDEN, q), "gate_up": w(2 * INTERMEDIATE, HIDDEN), "down": w(HIDDEN, INTERMEDIATE),
            "biases": [w(q + 2 * kv), w(HIDDEN), w(2 * INTERMEDIATE), w(HIDDEN)] if bias else [None] * 4}


def _rope(positions: torch.Tensor):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _reference(p: dict, x, cos, sin, key_cache, value_cache, slot_mapping, block_tables, qsl, seq_lens, **attention):
    """The layer from reference.py's pieces, on copies of the caches; attention: the attention options."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    q_w, kv_w, tokens = HEADS * D, KV_HEADS * D, x.shape[0]
    qkv = reference.linear(reference.rms_norm(x, p["in_norm"], EPS[0]), p["qkv"], p["biases"][0])
    q, k, v = qkv[:, :q_w].view(tokens, HEADS, D), qkv[:, q_w:q_w + kv_w].view(tokens, KV_HEADS, D), qkv[:, q_w + kv_w:]
    q, k = reference.rotary_embedding(q, k, cos, sin)
    reference.reshape_and_cache(k, v.reshape(tokens, KV_HEADS, D), key_cache, value_cache, slot_mapping)
    attn = reference.paged_prefill_attention(q, key_cache, value_cache, block_tables, qsl, seq_lens, 1 / math.sqrt(D),
                                             **attention)
    x = x + reference.linear(attn.reshape(tokens, -1), p["o"], p["biases"][1])
    gate_up = reference.linear(reference.rms_norm(x, p["post_norm"], EPS[1]), p["gate_up"], p["biases"][2])
    act = reference.silu_and_mul(gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:])
    return x + reference.linear(act, p["down"], p["biases"][3]), key_cache, value_cache


def _run(p: dict, x, cos, sin, key_cache, value_cache, slot_mapping, block_tables, qsl, seq_lens, max_query_len,
         attention=None, **overrides):
    args = {"weights": [p["in_norm"], pack_linear_weight(p["qkv"]), pack_linear_weight(p["o"]), p["post_norm"],
                        pack_linear_weight(p["gate_up"]), pack_linear_weight(p["down"])],
            "biases": p["biases"], "widths": [HEADS * D, KV_HEADS * D, KV_HEADS * D, D, INTERMEDIATE],
            "epsilons": list(EPS)}
    args.update(overrides)
    return library_ops.llama_decoder_layer(x, args["weights"], args["biases"], args["widths"], args["epsilons"],
                                           1 / math.sqrt(D), cos, sin, key_cache, value_cache, slot_mapping,
                                           block_tables, seq_lens, qsl, max_query_len, True, **(attention or {}))


def _step(query_lens, context_lens, seed=1):
    """A flat step: sequence s has context_lens[s] tokens cached and brings query_lens[s] new ones;
    each sequence owns 4 consecutive blocks."""
    g = torch.Generator().manual_seed(seed)
    key_cache, value_cache = ops.allocate_kv_cache(4 * len(query_lens), BLOCK, KV_HEADS, D)
    key_cache.normal_(generator=g)
    value_cache.normal_(generator=g)
    slots, positions, starts = [], [], [0]
    for s, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        positions += range(ctx, ctx + n)
        slots += [4 * s * BLOCK + pos for pos in range(ctx, ctx + n)]
        starts.append(starts[-1] + n)
    cos, sin = _rope(torch.tensor(positions))
    x = torch.randn(len(positions), HIDDEN, generator=g)
    block_tables = torch.arange(4 * len(query_lens), dtype=torch.int32).view(-1, 4)
    seq_lens = torch.tensor([n + c for n, c in zip(query_lens, context_lens)], dtype=torch.int32)
    return (x, cos, sin, key_cache, value_cache, torch.tensor(slots), block_tables,
            torch.tensor(starts, dtype=torch.int32), seq_lens)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("query_lens,context_lens", [([1, 1, 1], [5, 17, 30]), ([7, 1, 12], [0, 9, 3])])
def test_layer_matches_reference(cpu_isa, bias, query_lens, context_lens):
    p = _layer(bias)
    x, cos, sin, kc, vc, slots, tables, qsl, seq_lens = _step(query_lens, context_lens)
    want, want_k, want_v = _reference(p, x, cos, sin, kc, vc, slots, tables, qsl, seq_lens)
    got = _run(p, x, cos, sin, kc, vc, slots, tables, qsl, seq_lens, max(query_lens))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kc, want_k, rtol=1e-5, atol=1e-5)  # the new K/V landed in their slots
    torch.testing.assert_close(vc, want_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", [dict(sliding_window=5), dict(softcap=0.5),
                                       dict(sinks=torch.linspace(-2, 2, HEADS)),
                                       dict(sliding_window=9, softcap=0.7, sinks=torch.linspace(2, -1, HEADS))],
                         ids=["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("query_lens,context_lens", [([1, 1, 1], [5, 17, 30]), ([7, 1, 12], [0, 9, 3])])
def test_layer_takes_the_attention_options(cpu_isa, query_lens, context_lens, attention):
    """Mistral's window (and Gemma 2's softcap, gpt-oss's sinks) reach the layer's attention."""
    p = _layer(True)
    x, cos, sin, kc, vc, slots, tables, qsl, seq_lens = _step(query_lens, context_lens)
    want = _reference(p, x, cos, sin, kc, vc, slots, tables, qsl, seq_lens, **attention)[0]
    plain = _reference(p, x, cos, sin, kc, vc, slots, tables, qsl, seq_lens)[0]
    assert not torch.allclose(want, plain, rtol=1e-4, atol=1e-4), "the options must change this step"
    got = _run(p, x, cos, sin, kc, vc, slots, tables, qsl, seq_lens, max(query_lens), attention)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("override,error,words", [
    ({"weights": []}, ValueError, "weights"),
    ({"biases": [None]}, ValueError, "biases"),
    ({"widths": [HEADS * D, KV_HEADS * D]}, ValueError, "widths"),
    ({"widths": [HEADS * D, KV_HEADS * D, KV_HEADS * D, 0, INTERMEDIATE]}, ValueError, "widths"),
    ({"epsilons": [1e-5]}, ValueError, "epsilons"),
])
def test_bad_arguments_are_named(override, error, words):
    p = _layer(False)
    step = _step([1, 1], [3, 4])
    with pytest.raises(error, match=words):
        _run(p, *step, 1, **override)


def test_bad_hidden_and_slots_raise():
    p = _layer(False)
    x, *rest = _step([1, 1], [3, 4])
    with pytest.raises(ValueError, match="hidden"):
        _run(p, x.double(), *rest, 1)
    cos, sin, kc, vc, slots, tables, qsl, seq_lens = rest
    with pytest.raises((ValueError, IndexError, RuntimeError), match="slot"):
        _run(p, x, cos, sin, kc, vc, slots + 10_000, tables, qsl, seq_lens, 1)
