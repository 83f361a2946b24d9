"""The sampler on hand-made logits (no model): filters, seeds, logprobs, forks."""
from __future__ import annotations

import math

import torch

from kvpage import SamplingParams
from kvpage.engine import Sampler, SampleRow


def _draws(sampler, logits, params, times=200):
    return {sampler(logits, [SampleRow(params)]).tokens[0][0] for _ in range(times)}


def test_top_k_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    assert _draws(sampler, logits, SamplingParams(top_k=2)) == {0, 1}
    assert _draws(sampler, logits, SamplingParams(top_p=0.6)) == {0, 1}  # 0.5 before token 1 < 0.6
    assert _draws(sampler, logits, SamplingParams(top_p=0.5)) == {0}
    assert _draws(sampler, logits, SamplingParams(top_k=3, top_p=0.99)) == {0, 1, 2}
    assert _draws(sampler, logits, SamplingParams(temperature=0)) == {0}


def test_seeded_rows_ignore_the_rest_of_the_batch_and_logprobs_are_the_models():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    seeded = SamplingParams(seed=7, temperature=0.7, top_p=0.9)
    rows = [SampleRow(SamplingParams()), SampleRow(seeded, position=3), SampleRow(SamplingParams(temperature=0)),
            SampleRow(SamplingParams(top_k=5)), SampleRow(seeded, num_samples=3)]
    out = Sampler(seed=1)(logits, rows)
    alone = Sampler(seed=99)(logits[1:2], [SampleRow(seeded, position=3)])
    assert out.tokens[1] == alone.tokens[0]
    assert out.tokens[2] == [int(logits[2].argmax())]
    assert len(out.tokens[4]) == 3
    logp = logits.log_softmax(-1)
    for i, (toks, lps) in enumerate(zip(out.tokens, out.logprobs)):
        for t, lp in zip(toks, lps):
            assert math.isclose(lp, logp[i, t].item(), abs_tol=1e-5)
    # Fork samples are draws 0, 1, 2 of that row: sample 1 alone gives the same token.
    again = Sampler()(logits[4:5], [SampleRow(seeded, sample_index=1)])
    assert again.tokens[0] == [out.tokens[4][1]]


def test_a_vanishing_top_p_or_temperature_keeps_the_most_likely_token():
    # 1e-46 and 1e-300 pass the (0, 1] check but are 0 in float32; 1e-40 is a float32 subnormal.
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1)) * 4
    argmax = [[t] for t in logits.argmax(dim=-1).tolist()]
    for params in (SamplingParams(top_p=1e-46, seed=1), SamplingParams(top_p=1e-300),
                   SamplingParams(top_p=1e-46, top_k=3, temperature=2.0), SamplingParams(temperature=1e-300, seed=2),
                   SamplingParams(temperature=1e-40), SamplingParams(temperature=5e-324, top_p=0.5)):
        out = Sampler(seed=0)(logits, [SampleRow(params)] * 6)
        assert out.tokens == argmax, params
