"""The packed linear layer (pack_linear_weight + packed_linear) against ops/reference.py, on every CPU
ISA: ragged widths (a last slab of padding columns), every row count a pass can take, bias, views
of the input, 16-bit (bf16 / fp16) slabs, and bad input."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage.ops import reference
from kvpage.ops.layers import SLAB_COLUMNS, bf16_dot_available, pack_linear_weight, packed_linear, packed_pairs_shape


def _close(actual, expected, k):
    # fp32 sums of k products: error grows like sqrt(k) ulps of the operands' scale.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * k**0.5)


@given(rows=st.integers(1, 40), n=st.integers(1, 130), k=st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_packed_linear_matches_reference(cpu_isa, rows, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = pack_linear_weight(w)
    assert packed.shape == (-(-n // SLAB_COLUMNS), k, SLAB_COLUMNS)
    _close(packed_linear(x, packed, n, b), reference.linear(x, w, b), k)


def test_model_shapes_and_leading_dims(cpu_isa):
    """SmolLM2's fused q/k/v width at decode and prefill row counts; a [1, T, k] input keeps its dims."""
    w, b = torch.randn(960, 576) * 0.05, torch.randn(960)
    packed = pack_linear_weight(w)
    for rows in (1, 8, 9, 64, 257, 1000):  # 257, 1000: a prefill, in several row blocks
        x = torch.randn(1, rows, 576)
        out = packed_linear(x, packed, 960, b)
        assert out.shape == (1, rows, 960)
        _close(out, reference.linear(x, w, b), 576)


def test_a_row_gets_the_same_bits_in_any_batch(cpu_isa):
    """Each output is one in-order sum over k, whatever rows share its pass or row block: a prompt's
    logits do not depend on what else is in the step."""
    w, x = torch.randn(100, 64), torch.randn(300, 64)
    packed = pack_linear_weight(w)
    whole = packed_linear(x, packed, 100)
    for start, stop in ((0, 1), (5, 9), (127, 131), (200, 300)):
        assert torch.equal(packed_linear(x[start:stop], packed, 100), whole[start:stop])


def test_strided_input_and_weight_are_read_as_values():
    w = torch.randn(40, 100)[:, ::2]  # non-contiguous weight: packed from its values
    x = torch.randn(100, 7).T[:, :50]  # non-contiguous input
    _close(packed_linear(x, pack_linear_weight(w), 40), reference.linear(x, w), 50)


def test_packing_into_out_fills_it_as_a_fresh_pack_would():
    weight = torch.randn(70, 16)
    buffer = torch.full((3 * 16 * 48,), float("nan"))
    out = buffer[16 * 48:].view(2, 16, 48)  # a view into a larger buffer, as a model's arena holds them
    assert pack_linear_weight(weight, out=out) is out
    assert torch.equal(out, pack_linear_weight(weight))
    assert buffer[:16 * 48].isnan().all()  # nothing outside the view is touched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(rows=st.integers(1, 40), n=st.integers(1, 130), k=st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_16bit_slabs_compute_as_fp32_slabs_of_the_rounded_weight(cpu_isa, dtype, rows, n, k, bias, seed):
    """A 16-bit slab holds weight.to(dtype) (round to nearest even) and is widened exactly: the same
    bits as fp32 slabs of the rounded weight, and close to the reference over it."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    rounded = w.to(dtype).float()
    packed = pack_linear_weight(w, dtype=dtype)
    assert packed.dtype == dtype
    assert torch.equal(packed.float(), pack_linear_weight(rounded))
    out = packed_linear(x, packed, n, b)
    assert torch.equal(out, packed_linear(x, pack_linear_weight(rounded), n, b))
    _close(out, reference.linear(x, rounded, b), k)


def test_16bit_slabs_round_ties_to_even_and_keep_specials():
    # bf16 keeps 8 significand bits: 1 + 2^-8 is a tie (rounds down to 1), 1 + 3 * 2^-8 rounds up.
    w = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, float("inf"), -0.0, 1e-40, 3.0]])
    packed = pack_linear_weight(w, dtype=torch.bfloat16)
    assert torch.equal(packed[0, :, 0].float(), w[0].to(torch.bfloat16).float())
    finite = w[:, [0, 1, 3, 4, 5]]  # a product with inf would be 0 * inf = nan
    out = packed_linear(torch.eye(5), pack_linear_weight(finite, dtype=torch.bfloat16), 1)
    assert torch.equal(out[:, 0], finite[0].to(torch.bfloat16).float())


@given(rows=st.integers(1, 40), n=st.integers(1, 130), k=st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_bf16_dot_slabs_compute_over_bf16_rounded_operands(cpu_isa, rows, n, k, bias, seed):
    """Pair-interleaved bf16 slabs: x and W rounded to bf16, products exact, sums in fp32 (close to the
    reference over the rounded operands, clearly apart from the fp32 product); refused by name where
    the CPU or the active ISA has no bf16 dot products."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = pack_linear_weight(w, dtype=torch.bfloat16, bf16_dot=True)
    assert packed.shape == packed_pairs_shape(n, k) and packed.dtype == torch.bfloat16
    if not bf16_dot_available():
        with pytest.raises(ValueError, match="AVX512-BF16"):
            packed_linear(x, packed, n, b)
        return
    out = packed_linear(x, packed, n, b)
    _close(out, reference.linear(x.bfloat16().float(), w.bfloat16().float(), b), k)


def test_bf16_dot_pairs_hold_the_rounded_weight_pair_interleaved():
    w = torch.randn(50, 7)
    packed = pack_linear_weight(w, bf16_dot=True)  # [2 slabs, 4 pairs, 48, 2]
    unpacked = packed.float().permute(0, 2, 1, 3).reshape(96, 8)
    assert torch.equal(unpacked[:50, :7], w.bfloat16().float())
    assert not unpacked[50:].any() and not unpacked[:, 7:].any()  # padding columns and the odd k's pair


def test_bf16_dot_rounding_is_not_the_float32_product_and_rows_are_batch_independent():
    if not bf16_dot_available():
        return  # test_bf16_dot_slabs_compute_over_bf16_rounded_operands checks the refusal
    w, x = torch.randn(100, 577), torch.randn(300, 577)  # odd k: a zero-padded last pair; 3 row blocks
    packed = pack_linear_weight(w, bf16_dot=True)
    whole = packed_linear(x, packed, 100)
    assert (whole - reference.linear(x, w)).abs().max() > 1e-2
    _close(whole, reference.linear(x.bfloat16().float(), w.bfloat16().float()), 577)
    for start, stop in ((0, 1), (5, 9), (127, 131), (200, 300)):
        assert torch.equal(packed_linear(x[start:stop], packed, 100), whole[start:stop])


def test_zero_rows():
    assert packed_linear(torch.empty(0, 16), pack_linear_weight(torch.randn(5, 16)), 5).shape == (0, 5)


@pytest.mark.parametrize("call, match", [
    (lambda p: packed_linear(torch.randn(3, 15), p, 40), "input"),
    (lambda p: packed_linear(torch.randn(3, 16), p, 70), "out"),
    (lambda p: packed_linear(torch.randn(3, 16), p, 0), "out_features"),
    (lambda p: packed_linear(torch.randn(3, 16), p, 40, torch.randn(39)), "bias"),
    (lambda p: packed_linear(torch.randn(3, 16).double(), p, 40), "input"),
    (lambda p: packed_linear(torch.randn(3, 16), p[0], 40), "packed"),
    (lambda p: packed_linear(torch.randn(3, 16), p.double(), 40), "packed"),
    (lambda p: packed_linear(torch.randn(3, 16), p.to(torch.int16), 40), "packed"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), dtype=torch.float64), "dtype"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), dtype=torch.float8_e4m3fn), "dtype"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), out=torch.empty(1, 16, 48), dtype=torch.bfloat16), "out"),
    (lambda p: pack_linear_weight(torch.randn(40, 16).bfloat16(), dtype=torch.bfloat16), "weight"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), dtype=torch.float16, bf16_dot=True), "dtype"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), out=torch.empty(1, 8, 48, 2), bf16_dot=True), "out"),
    (lambda p: packed_linear(torch.randn(3, 17), pack_linear_weight(torch.randn(40, 16), bf16_dot=True), 40),
     "input"),
    (lambda p: pack_linear_weight(torch.randn(40)), "weight"),
    (lambda p: pack_linear_weight(torch.randn(0, 16)), "weight"),
    (lambda p: pack_linear_weight(torch.randn(4, 16, dtype=torch.float64)), "weight"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), out=torch.empty(2, 16, 48)), "out"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), out=torch.empty(1, 16, 48).double()), "out"),
    (lambda p: pack_linear_weight(torch.randn(40, 16), out=torch.empty(1, 48, 16).transpose(1, 2)), "out"),
])
def test_bad_input_names_the_argument(call, match):
    packed = pack_linear_weight(torch.randn(40, 16))
    with pytest.raises((ValueError, TypeError), match=match):
        call(packed)


@pytest.mark.parametrize("rows", [1, 3, 130])
def test_threads_share_the_slabs_without_changing_a_bit(cpu_isa, rows):
    """Slabs go to threads in runs from a shared counter (csrc/cpu/dispatch.h parallel_runs): every
    column is still computed whole by one thread, so any thread count gives the same bits (M = 1, a
    pass's few rows and several row blocks; 41 slabs, the last one ragged)."""
    w, x, b = torch.randn(1963, 77), torch.randn(rows, 77), torch.randn(1963)
    packed = pack_linear_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = packed_linear(x, packed, 1963, b)
        torch.set_num_threads(3)  # more threads than this machine's cores: runs interleave
        shared = packed_linear(x, packed, 1963, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
    _close(alone, reference.linear(x, w, b), 77)
