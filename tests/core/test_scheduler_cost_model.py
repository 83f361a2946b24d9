"""The swap-versus-recompute cost model: the seed's formulas, units, and the crossover it implies."""
import pytest

from kvpage.core import PreemptionCostModel, cost_model_from_measurements


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
