"""The preemption cost model measures the machine it runs on: a swap probe at start-up, every step's
forward pass timed, and llm.stats() reporting both and what they decide (a tiny random model)."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from integrity_helpers import CONTROL, PROMPTS, tiny_llm, workload
from kvpage.core import MeasuredCostModel, SchedulerOutput
from kvpage.engine.cost_measurement import cost_model_stats, probe_swap, record_step_time


@pytest.fixture(scope="module")
def llm():
    """A cache small enough that the workload preempts, by the cost model's choice."""
    return tiny_llm(num_kv_blocks=10)


def test_before_any_step_only_the_link_is_measured(llm):
    stats = llm.stats()
    assert 0 < stats["swap_bytes_per_s"] < math.inf and 0 <= stats["swap_overhead_s"] < 1
    assert stats["prefill_tokens_per_s"] is None and stats["preferred_preemption_mode"] is None


def test_steps_are_timed_and_the_stats_report_what_the_scheduler_decides_by(llm, monkeypatch):
    engine = llm.llm_engine
    assert engine.scheduler.config.cost_model is engine.cost_model  # the measured model decides
    outs, recorded = [], []
    real_execute, real_record = engine.runner.execute, engine.cost_model.record_step
    monkeypatch.setattr(engine.runner, "execute", lambda out: outs.append(out) or real_execute(out))
    monkeypatch.setattr(engine.cost_model, "record_step", lambda n, s: recorded.append((n, s)) or real_record(n, s))
    llm.generate(*workload(), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, stats
    # Every step's forward pass (a CPU's forward has finished when execute returns), but for the steps
    # that swapped (their time is partly the link's).
    unswapped = [out for out in outs if isinstance(out, SchedulerOutput)
                 and not (out.blocks_to_swap_out or out.blocks_to_swap_in)]
    assert [n for n, _ in recorded] == [out.num_batched_tokens for out in unswapped]
    assert all(0 < s < 60 for _, s in recorded)
    assert 0 < stats["prefill_tokens_per_s"] < math.inf
    assert stats["prefill_tokens_per_s"] == pytest.approx(1 / engine.cost_model.seconds_per_token)
    # The preference reported is the cost model's for a victim of the mean request's length.
    tokens = round((stats["num_prompt_tokens"] + stats["num_generation_tokens"]) / stats["num_finished"])
    assert stats["preferred_preemption_mode"] == engine.cost_model.choose(-(-tokens // 4), 4, tokens)
    crossover = stats["swap_preferred_from_tokens"]
    assert crossover is None or engine.cost_model.choose(-(-crossover // 4), 4, crossover) == "swap"


def test_a_step_still_running_on_the_device_is_not_timed():
    """On a GPU a step that read nothing back (a prompt chunk that samples nothing) has only been launched:
    its time would price recompute at launch cost."""
    model = MeasuredCostModel()
    out = SimpleNamespace(num_batched_tokens=64, blocks_to_swap_out=[], blocks_to_swap_in=[])
    record_step_time(model, out, time.perf_counter() - 0.01, finished=False)
    assert model.seconds_per_token is None
    record_step_time(model, out, time.perf_counter() - 0.01, finished=True)
    assert model.seconds_per_token is not None and model.seconds_per_token >= 0.01 / 64


def test_the_swap_probe_leaves_every_cache_as_it_was():
    llm = tiny_llm(num_kv_blocks=10)
    control = llm.generate([PROMPTS[0]], CONTROL, use_tqdm=False)[0].outputs[0].token_ids  # its blocks stay cached
    runner = llm.runner
    caches = [t for kv in runner.kv_caches + runner.host_kv_caches for t in kv]
    before = [t.clone() for t in caches]
    bytes_per_s, overhead_s = probe_swap(runner)
    assert 0 < bytes_per_s < math.inf and 0 <= overhead_s < 1
    assert all(torch.equal(a, b) for a, b in zip(before, caches))
    again = llm.generate([PROMPTS[0]], CONTROL, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == control  # read from probed blocks


def test_the_preferred_mode_is_a_fixed_one_and_recompute_without_a_host_pool():
    assert tiny_llm(num_kv_blocks=10, preemption_mode="recompute").stats()["preferred_preemption_mode"] == "recompute"
    model = MeasuredCostModel()
    model.set_link(1e9, 0.0)
    model.record_step(10, 1e-2)  # recompute: 1 ms per token; swap: far less
    assert cost_model_stats(model, 16, None, 10, 100.0)["preferred_preemption_mode"] == "swap"
    assert cost_model_stats(model, 16, None, 10, None)["preferred_preemption_mode"] is None  # no request yet
    assert cost_model_stats(model, 16, "recompute", 10, 100.0)["preferred_preemption_mode"] == "recompute"
    assert cost_model_stats(model, 16, "swap", 0, 100.0)["preferred_preemption_mode"] == "recompute"
