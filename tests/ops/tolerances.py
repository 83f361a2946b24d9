"""The one place tolerances are stated.

Attention computes in float32 in both the kernel and the reference, but in a different order
(online softmax over chunks, partition merges), so float32 outputs agree to a few ulps of the
accumulated sums; 16-bit outputs may then round to neighbouring values (1 ulp of fp16 near 2 is
~2e-3, of bf16 ~1.6e-2). Cache ops move bytes: they must match bit for bit."""
import torch

ATTENTION_TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# Log-sum-exps are float32 whatever the dtype (the scores are, in kernel and reference alike): they
# differ in the dot products' and sums' order and the kernels' exp, a few ulps of values up to ~10.
LSE_TOLERANCE = dict(atol=5e-5, rtol=1e-5)

_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_attention_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **ATTENTION_TOLERANCES[expected.dtype])


def assert_lse_close(actual, expected):
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **LSE_TOLERANCE)


def assert_bit_exact(actual, expected):
    """Equal bit patterns (so -0.0 vs 0.0 or NaN payloads would count as different)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    as_int = _SAME_WIDTH_INT.get(actual.dtype)
    if as_int is not None:
        actual, expected = actual.view(as_int), expected.view(as_int)
    assert torch.equal(actual, expected), "cache contents differ from the reference"
