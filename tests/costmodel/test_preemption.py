"""Swap vs recompute: a constant ratio under the linear model, a crossover only with a fixed
per-transfer overhead (the seed's preemption section, Llama-3-8B on an H100 over PCIe)."""
import math

import pytest

from kvpage.core import PreemptionCostModel
from kvpage.costmodel import Device, SwapRecompute, get_device, get_model

LLAMA, H100 = get_model("llama-3-8b"), get_device("h100")
# By hand: recompute 2 x 6,979,584,000 FLOPs a token at half of 989 TFLOP/s; swap 131,072 bytes a
# token out and back over 64 GB/s.
RECOMPUTE_PER_TOKEN = 2 * 6_979_584_000 / (0.5 * 989e12)
SWAP_PER_TOKEN = 2 * 131072 / 64e9


def test_the_ratio_is_the_same_at_every_length_without_overhead():
    model = SwapRecompute(LLAMA, H100)
    ratios = [model.ratio(n) for n in (1, 16, 500, 8192)]
    assert ratios == pytest.approx([RECOMPUTE_PER_TOKEN / SWAP_PER_TOKEN] * 4, rel=1e-12)
    assert 6.8 < ratios[0] < 7.0  # swap cheaper at every length
    assert model.crossover_tokens(with_overhead=False) == 1  # from the first token: no crossover


def test_a_fixed_overhead_creates_a_crossover_at_a_handful_of_tokens():
    model = SwapRecompute(LLAMA, H100)
    exact = 2 * 20e-6 / (RECOMPUTE_PER_TOKEN - SWAP_PER_TOKEN)
    assert model.crossover_exact() == pytest.approx(exact)
    assert 1 < exact < 2
    assert model.crossover_tokens(with_overhead=True) == math.ceil(exact)
    # Swapping whole 16-token blocks moves more bytes for a short sequence: the crossover moves up.
    blocks = model.crossover_tokens(with_overhead=True, block_size=16)
    assert blocks == 4
    assert model.swap_seconds(blocks - 1, True, 16) >= model.recompute_seconds(blocks - 1)
    assert model.swap_seconds(blocks, True, 16) < model.recompute_seconds(blocks)
    # With the overhead the ratio rises toward the linear one as the sequence grows.
    with_overhead = [model.ratio(n, with_overhead=True) for n in (1, 4, 64, 4096)]
    assert with_overhead == sorted(with_overhead)
    assert with_overhead[-1] < model.ratio(4096)


def test_a_bigger_overhead_pushes_the_crossover_out_linearly():
    crossovers = [SwapRecompute(LLAMA, H100.with_overhead(us * 1e-6)).crossover_exact() for us in (10, 20, 40)]
    assert crossovers[1] == pytest.approx(2 * crossovers[0])
    assert crossovers[2] == pytest.approx(4 * crossovers[0])


def test_when_recompute_is_cheaper_per_token_swap_never_wins():
    slow_link = Device("slow", "a slow link", memory_bytes=1e10, memory_bandwidth=1e12, peak_flops=1e15,
                       link_bandwidth=1e8, transfer_overhead_s=0.0)
    model = SwapRecompute(LLAMA, slow_link)
    assert model.crossover_exact() is None
    assert model.crossover_tokens(with_overhead=False) is None


def test_it_prices_exactly_as_the_schedulers_cost_model():
    core = SwapRecompute(LLAMA, H100).core()
    assert isinstance(core, PreemptionCostModel)
    assert core.swap_cost(3, 16) == pytest.approx(2 * (48 * 131072 / 64e9 + 20e-6))
    assert core.recompute_cost(100) == pytest.approx(100 * RECOMPUTE_PER_TOKEN)


def test_rows_report_the_engines_choice():
    rows = SwapRecompute(LLAMA, H100).rows([1, 4096], block_size=16)
    assert [r["engine_picks"] for r in rows] == ["recompute", "swap"]
    assert rows[0]["ratio_no_overhead"] == pytest.approx(rows[1]["ratio_no_overhead"])
    assert rows[1]["recompute_attention_s"] > rows[1]["recompute_s"]  # the causal term adds FLOPs


def test_a_flat_swap_fit_gives_an_infinite_ratio_not_a_division_error():
    """A link fitted as infinitely fast (time flat in size, CI's tiny model) makes swap free."""
    flat = Device("flat", "a flat fit", memory_bytes=2**30, memory_bandwidth=1e10, peak_flops=1e12,
                  link_bandwidth=math.inf, transfer_overhead_s=0.0)
    model = SwapRecompute(LLAMA, flat)
    assert model.swap_seconds(1024, False) == 0
    assert model.ratio(1024) == math.inf
