"""The fused layer ops (RMSNorm, SiLU-and-multiply, greedy sampling) against ops/reference.py, on
every CPU ISA, including strided rows, odd widths (vector tails), extremes and bad input."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage import ops
from kvpage.ops import reference
from kvpage.ops.layers import greedy_sample, rms_norm, rotary_embedding, silu_and_mul


@given(rows=st.integers(1, 9), width=st.integers(1, 700), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_rms_norm_matches_reference(cpu_isa, rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, width, generator=g) * 3, torch.randn(width, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_strided_rows_and_3d(cpu_isa):
    base, w = torch.randn(5, 1200), torch.randn(576)
    x = base[:, 10:586]  # rows 1200 apart, each contiguous
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(1, 7, 576)
    torch.testing.assert_close(rms_norm(x3, w, 1e-5), reference.rms_norm(x3, w, 1e-5), rtol=1e-5, atol=1e-5)


@given(rows=st.integers(1, 9), width=st.integers(1, 300), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_silu_and_mul_matches_reference(cpu_isa, rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, width, generator=g) * 8, torch.randn(rows, width, generator=g)
    torch.testing.assert_close(silu_and_mul(gate, up), reference.silu_and_mul(gate, up), rtol=1e-5, atol=1e-5)


def test_silu_extremes(cpu_isa):
    gate = torch.tensor([[-1000.0, -90.0, -1.0, 0.0, 1.0, 90.0, 1000.0, 3.0, -3.0]])
    up = torch.ones_like(gate)
    torch.testing.assert_close(silu_and_mul(gate, up), reference.silu_and_mul(gate, up), rtol=1e-5, atol=1e-5)


@given(rows=st.integers(1, 6), vocab=st.integers(1, 3000), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_greedy_sample_matches_reference(cpu_isa, rows, vocab, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    tokens, logprobs = greedy_sample(logits)
    ref_tokens, ref_logprobs = reference.greedy_sample(logits)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [49152, 151936])  # SmolLM2's and Qwen2's vocabularies
def test_greedy_logprob_over_a_real_vocabulary(cpu_isa, vocab):
    """A log-softmax over ~50k-150k entries: a float running sum would drift ~1e-4 from logsumexp."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    tokens, logprobs = greedy_sample(logits)
    expected = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits.double(), dim=-1)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-5)


def test_greedy_ties_pick_the_first_and_nan_wins(cpu_isa):
    logits = torch.zeros(3, 40)
    logits[0, [5, 17, 33]] = 2.0
    logits[1, 20] = float("nan")
    logits[2] = float("-inf")
    logits[2, 39] = 0.0
    tokens, logprobs = greedy_sample(logits)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist() == [5, 20, 39]
    assert torch.isnan(logprobs[1]) and logprobs[2].item() == 0.0


def test_non_cpu_fp32_inputs_fall_back_to_torch():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    logits = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(greedy_sample(logits)[0], logits.argmax(-1))


@pytest.mark.parametrize("call, match", [
    (lambda: ops.layers.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5), "weight"),
    (lambda: ops.layers.rms_norm(torch.randn(2, 8), torch.randn(8), -1.0), "epsilon"),
    (lambda: ops.layers.rms_norm("x", torch.randn(8), 1e-5), "input"),
    (lambda: ops.layers.silu_and_mul(torch.randn(2, 8), torch.randn(2, 9)), "gate and up"),
    (lambda: ops.layers.greedy_sample(torch.randn(8)), "logits"),
    (lambda: torch.ops.kvpage.greedy_sample(torch.empty(2, dtype=torch.int32), torch.empty(2), torch.randn(2, 5)),
     "tokens"),
    (lambda: torch.ops.kvpage.rms_norm(torch.empty(2, 8), torch.randn(2, 8, dtype=torch.float64), torch.randn(8),
                                       1e-5), "input"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@given(tokens=st.integers(1, 9), heads=st.integers(1, 5), half=st.integers(1, 80), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_rotary_embedding_matches_reference_bitwise(cpu_isa, tokens, heads, half, seed):
    """Bit-identical to HF's formula: no fused multiply-add in the kernel."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 3 * heads, 2 * half, generator=g)
    query, key = qkv[:, :2 * heads], qkv[:, 2 * heads:]  # strided views, as q/k of a fused projection
    cos, sin = torch.randn(tokens, 2 * half, generator=g), torch.randn(tokens, 2 * half, generator=g)
    for out, expected in zip(rotary_embedding(query, key, cos, sin), reference.rotary_embedding(query, key, cos, sin)):
        assert out.is_contiguous() and torch.equal(out, expected)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, c: rotary_embedding(q[0], k, c, c), "query"),
    (lambda q, k, c: rotary_embedding(q, k, c, c[:, :8]), "cos"),
    (lambda q, k, c: rotary_embedding(q, k[:2], c, c), "key"),
    (lambda q, k, c: rotary_embedding(q[..., :15], k[..., :15], c[:, :15], c[:, :15]), "head_size"),
])
def test_rotary_bad_input_names_the_argument(call, match):
    q, k, c = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, c)


def test_rotary_other_dtypes_take_the_reference_formula():
    q, k, c, s = (torch.randn(*shape, dtype=torch.float64) for shape in ((3, 4, 16), (3, 2, 16), (3, 16), (3, 16)))
    for out, expected in zip(rotary_embedding(q, k, c, s), reference.rotary_embedding(q, k, c, s)):
        assert out.dtype == torch.float64 and torch.equal(out, expected)
