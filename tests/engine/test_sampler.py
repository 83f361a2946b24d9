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
