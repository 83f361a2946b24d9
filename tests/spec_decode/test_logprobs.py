"""Log-probabilities with speculation are those without (greedy): cumulative_logprob and logprobs=k count
exactly the tokens the output keeps, also where a stop string, a stop token id or max_tokens cuts an accepted
run (the run's later tokens are taken back with their log-probabilities)."""
from __future__ import annotations

import pytest

from kvpage import SamplingParams

from spec_helpers import NGRAM, PROMPTS, assert_no_leaks, run, texts, token_ids

# The target scores a run of k + 1 query tokens in one step where decoding scores one token a step: the same
# numbers up to float rounding of the two kernel paths.
TOL = dict(rel=1e-4, abs=1e-4)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    outputs, _ = run(tiny_dir, PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    return outputs


def _cut_cases(reference, tokenizer, **extra) -> tuple[list[str], list[SamplingParams]]:
    """For each reference completion, a stop at every output token: max_tokens, and a stop string running
    from the middle of the text to the end of that token's text, so that some stops fall inside accepted runs
    (the repetitive completions' runs are long)."""
    prompts, cases = [], []
    for prompt, out in zip(PROMPTS, reference):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        anchor = len(text) // 2
        for i in range(1, len(ids)):
            prompts.append(prompt)
            cases.append(SamplingParams(temperature=0, max_tokens=i, **extra))
            end = len(tokenizer.decode(ids[:i + 1]))
            if end > anchor + 2:
                prompts.append(prompt)
                cases.append(SamplingParams(temperature=0, max_tokens=40, stop=[text[anchor:end]], **extra))
    return prompts, cases


def _assert_logprobs_match(outputs, ref) -> None:
    for out, expected in zip(outputs, ref):
        for c, e in zip(out.outputs, expected.outputs):
            assert c.cumulative_logprob == pytest.approx(e.cumulative_logprob, **TOL), (out.request_id, c.text)
            if e.logprobs is None:
                assert c.logprobs is None
                continue
            assert len(c.logprobs) == len(e.logprobs) == len(c.token_ids)
            for got, want in zip(c.logprobs, e.logprobs):
                assert list(got) == list(want)  # the sampled token, then the top-k, in order
                for token, lp in want.items():
                    assert got[token].rank == lp.rank and got[token].decoded_token == lp.decoded_token
                    assert got[token].logprob == pytest.approx(lp.logprob, **TOL)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_stops_inside_an_accepted_run_take_back_their_logprobs(tiny_dir, tokenizer, reference, logprobs):
    prompts, cases = _cut_cases(reference, tokenizer, logprobs=logprobs)
    ref, _ = run(tiny_dir, prompts, cases)
    outputs, llm = run(tiny_dir, prompts, cases, speculative_config=NGRAM)
    assert token_ids(outputs) == token_ids(ref)
    assert texts(outputs) == texts(ref)
    _assert_logprobs_match(outputs, ref)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0  # logprobs=k requests speculate too
    assert_no_leaks(llm)


def test_n_greater_than_one_with_logprobs(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=24, n=2, logprobs=1, stop=["fox jumps"])
    ref, _ = run(tiny_dir, PROMPTS, params)
    outputs, llm = run(tiny_dir, PROMPTS, params, speculative_config=NGRAM)
    assert token_ids(outputs) == token_ids(ref)
    _assert_logprobs_match(outputs, ref)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leaks(llm)
