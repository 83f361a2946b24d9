"""Greedy outputs are the same with speculation on and off (n-gram and draft-model proposals), through the
paths the bookkeeping has: prefix caching, chunked prefill, n > 1, stop strings / stop ids / max_tokens inside
an accepted run, and preemption by swap and by recompute (forced with a tiny pool, and checked to have
happened). Every run ends with no block held and the pools consistent (no leaks)."""
from __future__ import annotations

import pytest

from kvpage import SamplingParams

from spec_helpers import NGRAM, PROMPTS, assert_no_leaks, run, texts, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    outputs, _ = run(tiny_dir, PROMPTS, GREEDY)
    return outputs


def _spec_stats(llm) -> dict:
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_ngram_greedy_identical(tiny_dir, reference, prefix_caching):
    outputs, llm = run(tiny_dir, PROMPTS, GREEDY, speculative_config=NGRAM, enable_prefix_caching=prefix_caching)
    assert token_ids(outputs) == token_ids(reference)
    assert texts(outputs) == texts(reference)
    stats = _spec_stats(llm)
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1
    assert stats["spec_decode_mean_accepted_length"] > 1
    assert_no_leaks(llm)


def test_prefix_cache_hashes_only_accepted_tokens(tiny_dir, reference):
    """The same prompts again hit the blocks the first run cached: were a draft token ever hashed, the
    second run's greedy tokens (read from those blocks) would differ."""
    outputs, llm = run(tiny_dir, PROMPTS, GREEDY, speculative_config=NGRAM)
    prompts2 = [p + out.outputs[0].text for p, out in zip(PROMPTS, outputs)]
    again = llm.generate(prompts2, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    fresh, _ = run(tiny_dir, prompts2, SamplingParams(temperature=0, max_tokens=8), enable_prefix_caching=False)
    assert token_ids(again) == token_ids(fresh)
    assert_no_leaks(llm)


def test_chunked_prefill_and_a_small_token_budget(tiny_dir, reference):
    # 8 tokens a step: prompts are chunked, and drafts often do not fit the budget left (then dropped).
    outputs, llm = run(tiny_dir, PROMPTS, GREEDY, speculative_config=NGRAM, max_num_batched_tokens=8)
    assert token_ids(outputs) == token_ids(reference)
    assert _spec_stats(llm)["spec_decode_num_drafts"] > 0
    assert_no_leaks(llm)


def test_n_greater_than_one(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=30, n=2)
    ref, _ = run(tiny_dir, PROMPTS, params)
    outputs, llm = run(tiny_dir, PROMPTS, params, speculative_config=NGRAM)
    assert token_ids(outputs) == token_ids(ref)
    assert _spec_stats(llm)["spec_decode_num_drafts"] > 0
    assert llm.stats()["num_copy_on_write"] > 0  # the forks' shared last block, written by a speculating step
    assert_no_leaks(llm)


def test_stops_inside_an_accepted_run(tiny_dir, reference):
    """Stop strings, stop token ids and max_tokens cut a run where decoding one token at a time stops."""
    full = [out.outputs[0] for out in reference]
    cases = []
    for c in full:
        text, ids = c.text, c.token_ids
        cases.append(SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2:len(text) // 2 + 3]]))
        cases.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[len(ids) * 2 // 3]]))
        cases.append(SamplingParams(temperature=0, max_tokens=len(ids) // 2 + 1))
        cases.append(SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 3:len(text) // 3 + 2]],
                                    include_stop_str_in_output=True))
    prompts = [p for p in PROMPTS for _ in range(4)]
    ref, _ = run(tiny_dir, prompts, cases)
    outputs, llm = run(tiny_dir, prompts, cases, speculative_config=NGRAM)
    assert token_ids(outputs) == token_ids(ref)
    assert texts(outputs) == texts(ref)
    assert [[c.finish_reason for c in o.outputs] for o in outputs] == [[c.finish_reason for c in o.outputs] for o in ref]
    assert _spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption(tiny_dir, mode):
    """A pool too small for every sequence at once: requests are preempted (by `mode`) and resumed."""
    prompts = PROMPTS * 3
    params = SamplingParams(temperature=0, max_tokens=48)
    options = dict(num_kv_blocks=48, block_size=4, preemption_mode=mode, swap_space_gib=0.01)
    ref, ref_llm = run(tiny_dir, prompts, params, **options)
    outputs, llm = run(tiny_dir, prompts, params, speculative_config=NGRAM, **options)
    assert token_ids(outputs) == token_ids(ref)
    stats = llm.stats()
    assert stats[f"num_{mode}_preemptions"] > 0
    assert stats["num_preemptions"] == stats[f"num_{mode}_preemptions"]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_draft_model_is_its_own_draft(tiny_dir, reference):
    """The target as its own draft: every proposal is the target's greedy token (full acceptance, up to
    ties between the two forward implementations)."""
    config = {"method": "draft_model", "model": tiny_dir, "num_speculative_tokens": 3}
    outputs, llm = run(tiny_dir, PROMPTS, GREEDY, speculative_config=config)
    assert token_ids(outputs) == token_ids(reference)
    stats = _spec_stats(llm)
    assert stats["spec_decode_acceptance_rate"] > 0.9
    assert stats["spec_decode_mean_accepted_length"] > 2.5
    assert_no_leaks(llm)


def test_draft_model_other_random_model(tiny_dir, draft_dir, reference):
    config = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2}
    outputs, llm = run(tiny_dir, PROMPTS, GREEDY, speculative_config=config)
    assert token_ids(outputs) == token_ids(reference)
    assert _spec_stats(llm)["spec_decode_num_drafts"] > 0
    assert_no_leaks(llm)


def test_ineligible_requests_do_not_speculate(tiny_dir):
    """Penalties, min_tokens and beam search decode one token a step; their outputs are unchanged (logprobs=k
    requests speculate: test_logprobs)."""
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=20, logprobs=2),
              SamplingParams(max_tokens=12, beam_width=2)]
    prompts = PROMPTS[:3]
    ref, _ = run(tiny_dir, prompts, params)
    outputs, llm = run(tiny_dir, prompts, params, speculative_config=NGRAM)
    assert token_ids(outputs) == token_ids(ref)
    assert [[c.logprobs for c in o.outputs] for o in outputs] == [[c.logprobs for c in o.outputs] for o in ref]
    assert _spec_stats(llm)["spec_decode_num_drafts"] == 0
    assert_no_leaks(llm)


def test_sampled_requests_speculate_and_finish(tiny_dir):
    """Seeded sampling with speculation: runs, accepts, reproduces itself, leaks nothing (its distribution:
    test_rejection_sampling)."""
    params = SamplingParams(temperature=0.3, top_p=0.95, seed=5, max_tokens=30)
    a, llm = run(tiny_dir, PROMPTS, params, speculative_config=NGRAM)
    b, _ = run(tiny_dir, PROMPTS, params, speculative_config=NGRAM)
    assert token_ids(a) == token_ids(b)
    assert all(len(o.outputs[0].token_ids) == 30 or o.outputs[0].finish_reason == "stop" for o in a)
    assert_no_leaks(llm)
