"""Engine integrity: one failed call never breaks the LLM.

Faults (a KeyboardInterrupt, or an ordinary exception standing for a bug) are raised at random lines
of the bookkeeping while generate() runs a workload that takes every path (prefix hits, forks,
preemption under a small cache, stop strings, bad words, prompt logprobs, beam search); afterwards
the pools must be whole, nothing may hold a block, and a greedy control request must give the tokens
it gave before. Then threads, and the bad inputs that used to get past admission.
"""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings, strategies as st

from integrity_helpers import (CONTROL, PROMPTS, Injected, Injector, assert_whole_and_idle, control_tokens, count_lines,
                               run_with_fault, tiny_llm, workload)
from kvpage import SamplingParams


@pytest.fixture(scope="module", params=["swap", "recompute"])
def llm(request):
    """A cache small enough that the workload preempts, by the given mode."""
    return tiny_llm(num_kv_blocks=10, preemption_mode=request.param)


@pytest.fixture(scope="module")
def baseline(llm):
    prompts, params = workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return control_tokens(llm), [[c.token_ids for c in o.outputs] for o in outputs], count_lines(llm)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_the_workload_exercises_preemption_and_prefix_hits(llm, baseline):
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert stats["num_copy_on_write"] > 0, stats
    mode = llm.llm_engine.scheduler.preemption_mode
    assert stats["num_swap_preemptions" if mode == "swap" else "num_recompute_preemptions"] > 0, stats


@settings(max_examples=12)
@given(fraction=st.floats(0.0, 1.0), bug=st.booleans())
def test_a_fault_anywhere_leaves_the_engine_whole(llm, baseline, fraction, bug):
    control, expected, num_lines = baseline
    target = 1 + int(fraction * (num_lines - 1))
    outputs = run_with_fault(llm, target, Injected if bug else KeyboardInterrupt)
    assert_whole_and_idle(llm)
    if outputs is not None:  # the fault fell in a deferred section, or past the last line
        assert _tokens(outputs) == expected
    assert control_tokens(llm) == control


def test_faults_spread_over_one_small_request(llm, baseline):
    """40 lines spread evenly over one greedy request, each as an interrupt and as a bug."""
    one = ([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3))
    with Injector() as counter:
        llm.generate(*one, use_tqdm=False)
    for target in range(1, counter.count + 1, max(1, counter.count // 40)):
        for exc in (KeyboardInterrupt, Injected):
            try:
                with Injector(target, exc):
                    llm.generate(*one, use_tqdm=False)
            except (KeyboardInterrupt, Injected):
                pass
            assert_whole_and_idle(llm)
    assert control_tokens(llm) == baseline[0]


@pytest.mark.parametrize("num_threads", [2, 4])
def test_threads_get_their_single_thread_outputs(llm, baseline, num_threads):
    prompts, params = workload()
    expected = baseline[1]
    results, errors = {}, []

    def call(i):
        try:
            results[i] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == num_threads
    assert all(r == expected for r in results.values())
    assert_whole_and_idle(llm)


# -- bad input that used to get past admission ------------------------------------------------------

@pytest.mark.parametrize("params, match", [
    (SamplingParams(logprobs=21), "logprobs=21 exceeds max_logprobs=20"),
    (SamplingParams(prompt_logprobs=10**6), "prompt_logprobs=1000000 exceeds max_logprobs=20"),
])
def test_logprobs_are_capped_at_max_logprobs(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert_whole_and_idle(llm)


def test_max_logprobs_raises_the_cap(llm):
    wide = tiny_llm(max_logprobs=-1)
    out = wide.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=50), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 50
    with pytest.raises(ValueError, match="max_logprobs"):
        tiny_llm(max_logprobs=-2)


@pytest.mark.parametrize("prompt, options, match", [
    ("a \ud800 b", {}, "prompt cannot be encoded as UTF-8"),
    ("hi", {"bad_words": ["\ud800"]}, r"bad_words\[0\] cannot be encoded"),
    ("hi", {"stop": ["ok", "\udfff"]}, r"stop\[1\] cannot be encoded"),
])
def test_text_that_is_not_utf8_is_refused_by_name(llm, prompt, options, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=2, **options), use_tqdm=False)
    assert_whole_and_idle(llm)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user"}], r"messages\[0\]: content must be a string, got nothing"),
    ([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}], r"messages\[1\]: role must be"),
    ([{"role": "user", "content": "\ud800"}], r"messages\[0\] content cannot be encoded"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": 3}]], r"messages\[1\]\[0\]: content"),
])
def test_chat_messages_are_checked_by_name(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert_whole_and_idle(llm)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_seeds_outside_64_bits_are_refused(seed):
    with pytest.raises(ValueError, match="seed must be an int in"):
        SamplingParams(seed=seed)


def test_an_orphan_can_not_be_left_by_a_failing_admission(llm, baseline, monkeypatch):
    """Anything raised while the request is being built (here: building its bad-words ids) leaves
    neither the scheduler nor the engine holding it."""
    import kvpage.engine.request_intake as request_intake

    def boom(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(request_intake, "bad_words_token_ids", boom)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0], PROMPTS[1]], [CONTROL, SamplingParams(bad_words=["x"])], use_tqdm=False)
    assert_whole_and_idle(llm)
    monkeypatch.undo()
    assert control_tokens(llm) == baseline[0]


def test_max_model_len_lowers_the_context_limit():
    short = tiny_llm(max_model_len=12)
    ids = list(range(5, 15))  # 10 prompt tokens
    out = short.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds max_model_len=12"):
        short.generate([list(range(5, 18))], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's context of 512"):
        tiny_llm(max_model_len=100_000)
