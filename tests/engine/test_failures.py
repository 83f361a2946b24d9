"""Failures inside and before a step: the engine checks what it can up front, and whatever still goes
wrong in a step (the runner raising, a KeyboardInterrupt, a MemoryError) leaves the same LLM
generating exactly as it did before, with every block it held back."""
from __future__ import annotations

import math

import pytest

from engine_helpers import PROMPTS, make_llm
from kvpage import SamplingParams

PROMPT = PROMPTS[1]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


class InjectedFailure(Exception):
    pass


def _fail_execute(monkeypatch, runner, on_calls, exc=InjectedFailure, after_work=False):
    """Make runner.execute raise `exc` on the calls numbered in `on_calls` (1 = the first), before its
    work or after it (the step's swaps, copies and cache writes done, its logits lost)."""
    real, calls = runner.execute, []

    def execute(batch):
        calls.append(batch)
        if len(calls) not in on_calls:
            return real(batch)
        if after_work:
            real(batch)
        raise exc(f"injected into call {len(calls)}")

    monkeypatch.setattr(runner, "execute", execute)
    return calls


def _token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _assert_idle(llm, blocks_used):
    stats = llm.stats()
    assert stats["kv_blocks_used"] == blocks_used, stats
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0, stats
    assert not llm.llm_engine.has_unfinished_requests()


# -- 1a: a SamplingParams changed after construction is checked again ---------------------------

@pytest.mark.parametrize("name,value", [("stop", 5), ("stop_token_ids", 5), ("temperature", -1.0),
                                        ("top_p", 0.0), ("max_tokens", 0), ("beam_width", "2")])
def test_a_mutated_sampling_params_is_rejected_before_anything_runs(llm, name, value):
    before = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    used, steps = llm.stats()["kv_blocks_used"], llm.stats()["num_steps"]
    params = SamplingParams(temperature=0, max_tokens=4)
    setattr(params, name, value)  # a dataclass does not check assignments
    with pytest.raises(ValueError, match=f"prompt 0: {name}"):
        llm.generate(PROMPT, params, use_tqdm=False)
    with pytest.raises(ValueError, match=name):
        llm.llm_engine.add_request("mutated", PROMPT, params)
    assert llm.stats()["num_steps"] == steps
    _assert_idle(llm, used)
    assert _token_ids(llm.generate(PROMPT, GREEDY, use_tqdm=False)) == _token_ids(before)


# -- 1b: an exception inside a step -------------------------------------------------------------

@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError, InjectedFailure])
@pytest.mark.parametrize("call,after_work", [(1, False), (3, False), (3, True)])
def test_generate_withdraws_its_requests_when_a_step_raises(llm, monkeypatch, exc, call, after_work):
    prompts = [PROMPT, PROMPTS[11], PROMPTS[2]]
    params = [GREEDY, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8), GREEDY]
    before = llm.generate(prompts, params, use_tqdm=False)
    used = llm.stats()["kv_blocks_used"]
    calls = _fail_execute(monkeypatch, llm.runner, {call}, exc, after_work)
    with pytest.raises(exc, match=f"call {call}"):
        llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) == call  # it stopped at the failure
    _assert_idle(llm, used)
    assert _token_ids(llm.generate(prompts, params, use_tqdm=False)) == _token_ids(before)


def test_a_failed_beam_search_frees_its_blocks(llm, monkeypatch):
    beam = SamplingParams(beam_width=2, max_tokens=6)
    before = llm.generate(PROMPT, beam, use_tqdm=False)
    used = llm.stats()["kv_blocks_used"]
    _fail_execute(monkeypatch, llm.runner, {3})
    with pytest.raises(InjectedFailure):
        llm.generate(PROMPT, beam, use_tqdm=False)
    _assert_idle(llm, used)
    monkeypatch.undo()
    assert _token_ids(llm.generate(PROMPT, beam, use_tqdm=False)) == _token_ids(before)


@pytest.fixture(scope="module")
def small_llm(llm):
    """A cache small enough that these prompts preempt by swap (and n=2 copies on write)."""
    return make_llm(llm, num_kv_blocks=16, preemption_mode="swap")


def _engine_run(llm, prompts, params, fail_on=frozenset(), after_work=False, monkeypatch=None):
    """Requests added straight to the LLMEngine (not generate()'s to withdraw), stepped to the end;
    a step that raises is just retried. Returns the outputs and how many steps failed."""
    engine = llm.llm_engine
    if fail_on:
        _fail_execute(monkeypatch, llm.runner, fail_on, after_work=after_work)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"user{i}", prompt, sp, stream=False)
    done, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        except InjectedFailure:
            failures += 1
    return [done[f"user{i}"] for i in range(len(prompts))], failures


@pytest.mark.parametrize("after_work", [False, True])
def test_user_requests_finish_as_undisturbed_after_failed_steps(small_llm, monkeypatch, after_work):
    prompts = PROMPTS[8:14]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)] * 3
    undisturbed, _ = _engine_run(small_llm, prompts, params)
    stats = small_llm.stats()
    assert stats["num_swap_preemptions"] > 0 and stats["num_copy_on_write"] > 0, stats  # the hard cases happen
    failed_before = stats["num_steps"]
    outputs, failures = _engine_run(small_llm, prompts, params, frozenset(range(2, 200, 3)), after_work, monkeypatch)
    assert failures > 5 and small_llm.stats()["num_steps"] > failed_before
    assert _token_ids(outputs) == _token_ids(undisturbed)
    _assert_idle(small_llm, 0)


# -- 2: beam requests are checked with the others, before anything runs --------------------------

def test_beam_prompts_are_checked_before_anything_runs(llm, small_llm):
    steps = llm.stats()["num_steps"], small_llm.stats()["num_steps"]
    too_long = [1] * (llm.llm_engine.config.max_model_len + 1)
    beam = SamplingParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="prompt 0: .*exceeds max_model_len"):
        llm.generate([too_long], beam, use_tqdm=False)
    vocab = llm.runner.vocab_size
    with pytest.raises(ValueError, match="prompt 1: prompt token ids must lie in"):
        llm.generate([PROMPT, [1, vocab]], [GREEDY, beam], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 2: .*num_kv_blocks"):
        small_llm.generate([PROMPT, PROMPT, PROMPTS[14]], [GREEDY, beam, SamplingParams(beam_width=8)],
                           use_tqdm=False)
    assert (llm.stats()["num_steps"], small_llm.stats()["num_steps"]) == steps  # the good prompts never ran
    _assert_idle(llm, 0)
    _assert_idle(small_llm, 0)


# -- 3: a tiny top_p or temperature still samples from the distribution's top -------------------

@pytest.mark.parametrize("params", [SamplingParams(top_p=1e-46, seed=1, max_tokens=8),
                                    SamplingParams(top_p=1e-300, max_tokens=8),
                                    SamplingParams(temperature=1e-300, seed=1, max_tokens=8),
                                    SamplingParams(temperature=1e-40, top_k=5, max_tokens=8)])
def test_a_vanishing_top_p_or_temperature_is_greedy(llm, params):
    greedy = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == greedy.token_ids
    assert math.isclose(got.cumulative_logprob, greedy.cumulative_logprob, abs_tol=1e-3)


def test_a_requeued_request_is_queried_in_the_prefix_cache_once(llm, monkeypatch):
    """A request requeued by a failed step (Scheduler.recover) is re-admitted: no new prefix-cache query, as
    after recompute preemption (scheduler_planner._is_first_admission), so the queried tokens are each prompt's
    once and the hits agree with the requests' num_cached_tokens."""
    before = llm.stats()
    prompts = PROMPTS[2:5]
    outputs, failures = _engine_run(llm, prompts, [GREEDY] * len(prompts), frozenset({1, 2}), monkeypatch=monkeypatch)
    stats = llm.stats()
    assert failures == 2
    queried = stats["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    assert queried == sum(len(o.prompt_token_ids) for o in outputs)
    hits = stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits == sum(o.num_cached_tokens for o in outputs)
