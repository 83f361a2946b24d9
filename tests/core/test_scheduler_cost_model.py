"""The swap-versus-recompute cost model: the seed's formulas, units, and the crossover it implies; and
the same model priced with measured numbers (MeasuredCostModel), fed made-up measurements here."""
import math

import pytest

from kvpage.core import MeasuredCostModel, PreemptionCostModel, cost_model_from_measurements


def test_swap_cost_is_a_round_trip_of_bytes_over_the_link_plus_fixed_overhead():
    model = PreemptionCostModel(kv_bytes_per_token=1000, link_bandwidth=1e9, transfer_overhead_s=1e-5)
    assert model.swap_cost(0, 16) == 0
    assert model.swap_cost(2, 16) == pytest.approx(2 * (32 * 1000 / 1e9 + 1e-5))


def test_recompute_cost_is_prefill_flops_over_the_flop_rate():
    linear = PreemptionCostModel(n_params=1e9, flops_per_s=1e12, attention_term=False)
    assert linear.recompute_cost(100) == pytest.approx(2 * 1e9 * 100 / 1e12)
    with_attention = PreemptionCostModel(n_params=1e9, flops_per_s=1e12, num_layers=2, hidden_size=64)
    assert with_attention.recompute_cost(100) == pytest.approx((2e11 + 2 * 2 * 64 * 100 * 100) / 1e12)


def test_the_overhead_makes_recompute_win_short_and_swap_win_long():
    model = PreemptionCostModel()
    crossover = model.crossover_tokens(16)
    assert crossover is not None and 1 < crossover < 1000
    assert model.choose(1, 16, 8) == "recompute"
    assert model.choose(64, 16, 1024) == "swap"
    # Without the fixed overhead, the linear terms alone pick swap at every length (the seed's point).
    no_overhead = PreemptionCostModel(transfer_overhead_s=0.0, attention_term=False)
    assert no_overhead.crossover_tokens(1) == 1
    slow_link = PreemptionCostModel(link_bandwidth=1e6, attention_term=False)
    assert slow_link.crossover_tokens(16) is None


def test_measurements_are_taken_in_engine_units():
    model = cost_model_from_measurements(kv_bytes_per_token=2048, n_params=7e9, link_bandwidth_gbs=20,
                                         transfer_overhead_us=15, achievable_tflops=300)
    assert (model.link_bandwidth, model.flops_per_s) == (20e9, 300e12)
    assert model.transfer_overhead_s == pytest.approx(15e-6)
    assert not model.attention_term
    with pytest.raises(ValueError, match="link_bandwidth"):
        cost_model_from_measurements(kv_bytes_per_token=2048, n_params=7e9, link_bandwidth_gbs=0,
                                     transfer_overhead_us=15, achievable_tflops=300)


# -- the cost model with this machine's numbers (the engine measures, core decides) ---------------

def measured(bytes_per_s: float, overhead_s: float, seconds_per_token: float) -> MeasuredCostModel:
    """Made-up measurements: a link, and steps of 8..512 tokens taking 2 ms + seconds_per_token each."""
    model = MeasuredCostModel(PreemptionCostModel(kv_bytes_per_token=1000))
    model.set_link(bytes_per_s, overhead_s)
    for n in (8, 64, 512, 16, 256, 32):
        model.record_step(n, 2e-3 + seconds_per_token * n)
    return model


def test_a_fast_link_swaps_and_a_slow_one_recomputes():
    # Recompute: 1e-4 s per token. Swap: 2 x 1000 bytes per token over the link, plus 2 x 1 ms.
    fast = measured(bytes_per_s=1e9, overhead_s=1e-3, seconds_per_token=1e-4)  # 2 us per token
    slow = measured(bytes_per_s=1e6, overhead_s=1e-3, seconds_per_token=1e-4)  # 2 ms per token
    for tokens in (64, 256, 4096):
        blocks = tokens // 16
        assert fast.choose(blocks, 16, tokens) == "swap"
        assert slow.choose(blocks, 16, tokens) == "recompute"
    # Where the fixed overhead is paid back: 2 ms / (1e-4 - 2e-6) s per token = 20.4 tokens.
    assert fast.crossover_tokens(1) == math.ceil(2e-3 / (1e-4 - 2e-6))
    assert fast.choose(1, 16, 16) == "recompute"
    assert slow.crossover_tokens(16) is None


def test_the_step_rate_is_the_marginal_cost_and_outliers_move_nothing():
    model = MeasuredCostModel()
    assert model.seconds_per_token is None and model.prefill_tokens_per_s is None
    model.record_step(100, 0.05)  # one step size only: the average cost per token stands in
    assert model.seconds_per_token == pytest.approx(0.05 / 100)
    model.record_step(0, 0.01)  # an empty step teaches nothing
    assert model.seconds_per_token == pytest.approx(0.05 / 100)
    sizes = [1, 4, 16, 64, 256, 1024, 8, 32, 128, 512]
    for n in sizes:
        model.record_step(n, 0.01 + 2e-4 * n)
    for n in sizes[:3]:  # a few steps stretched by another process on the machine
        model.record_step(n, 0.01 + 2e-4 * n + 0.5)
    assert model.seconds_per_token == pytest.approx(2e-4, rel=1e-6)
    assert model.prefill_tokens_per_s == pytest.approx(5000, rel=1e-6)


def test_the_window_follows_a_change_of_load():
    model = MeasuredCostModel(window=8)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        model.record_step(n, 1e-3 * n)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):  # the machine got four times slower
        model.record_step(n, 4e-3 * n)
    assert model.seconds_per_token == pytest.approx(4e-3)


def test_unmeasured_numbers_are_the_priors():
    prior = PreemptionCostModel(kv_bytes_per_token=512, link_bandwidth=3e9, flops_per_s=1e12)
    model = MeasuredCostModel(prior)
    assert model.current() == prior
    model.record_step(10, 1e-3)
    current = model.current()
    assert (current.link_bandwidth, current.transfer_overhead_s) == (prior.link_bandwidth, prior.transfer_overhead_s)
    assert current.recompute_cost(10) == pytest.approx(1e-3)  # the measured rate, not the FLOP terms
    model.set_link(1e8, 0.0)
    assert (model.current().link_bandwidth, model.current().transfer_overhead_s) == (1e8, 0.0)


@pytest.mark.parametrize("call,match", [
    (lambda m: m.set_link(0, 1e-5), "bytes_per_s"), (lambda m: m.set_link(math.inf, 1e-5), "bytes_per_s"),
    (lambda m: m.set_link(1e9, -1), "overhead_s"), (lambda m: m.record_step(-1, 0.1), "num_tokens"),
    (lambda m: m.record_step(4, math.nan), "seconds"), (lambda m: MeasuredCostModel(window=1), "window"),
    (lambda m: PreemptionCostModel(prefill_tokens_per_s=0), "prefill_tokens_per_s")])
def test_bad_measurements_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call(MeasuredCostModel())
