"""Rejection sampling keeps the target distribution: with deterministic (one-hot) proposals, each emitted
token, at every position of the run, is distributed as the target's p (after temperature, top-k / top-p),
checked by a chi-square bound over many fixed-seed draws from a tiny vocabulary (deterministic: no flakes)."""
from __future__ import annotations

import torch

from kvpage import SamplingParams
from kvpage.spec_decode.verify import SpecRow, Verifier, target_probs

VOCAB = 6
DRAWS = 6000
# chi-square critical value for 5 degrees of freedom at p = 0.001: a correct sampler passes 999 seeds in 1000,
# and the seed is fixed, so the test is deterministic.
CHI2_CRIT_DF5 = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(3, VOCAB, generator=g) * 1.5


def _emitted(params: SamplingParams, drafts: list[int], seed: int = 0):
    """Counts of the first and (after an accepted first draft) second emitted token over DRAWS runs."""
    logits = _logits()
    verifier = Verifier(seed)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    accepted = 0
    for _ in range(DRAWS):
        out = verifier(logits, [SpecRow(drafts, params)])
        first[out[0].tokens[0]] += 1
        if out[0].num_accepted >= 1:
            second[out[0].tokens[1]] += 1
        accepted += out[0].num_accepted
    return logits, first, second, accepted


def test_first_token_keeps_target_distribution():
    params = SamplingParams(temperature=1.0)
    logits, first, second, accepted = _emitted(params, drafts=[2, 4])
    p = target_probs(logits, params)
    assert chi_square(first, p[0]) < CHI2_CRIT_DF5
    # Given the first draft was accepted, the next emitted token is distributed as row 1's p.
    assert second.sum() > 500
    assert chi_square(second, p[1]) < CHI2_CRIT_DF5
    assert 0 < accepted < 2 * DRAWS


def test_temperature_and_filters_are_the_targets():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    logits, first, _, _ = _emitted(params, drafts=[0], seed=1)
    p = target_probs(logits, params)
    assert (p[0] == 0).sum() >= 2  # the filters cut tokens, which must never come out
    df = int((p[0] > 0).sum()) - 1
    crit = {1: 10.83, 2: 13.82, 3: 16.27}[df]  # chi-square at p = 0.001
    assert chi_square(first, p[0]) < crit


def test_a_proposal_of_probability_zero_is_always_rejected():
    params = SamplingParams(temperature=0.5, top_k=1)
    logits = _logits()
    best = int(logits[0].argmax())
    draft = (best + 1) % VOCAB
    out = Verifier(0)(logits, [SpecRow([draft], params)])[0]
    assert out.num_accepted == 0 and out.tokens == [best]


def test_greedy_accepts_while_argmax_matches():
    logits = _logits()
    argmax = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0)
    out = Verifier(0)(logits, [SpecRow(argmax[:2], greedy)])[0]
    assert out.tokens == argmax and out.num_accepted == 2  # all accepted, then the bonus token
    wrong = (argmax[1] + 1) % VOCAB
    out = Verifier(0)(logits, [SpecRow([argmax[0], wrong], greedy)])[0]
    assert out.tokens == argmax[:2] and out.num_accepted == 1
    lp = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == [lp[0, argmax[0]].item(), lp[1, argmax[1]].item()]


def test_seeded_rows_are_reproducible():
    params = SamplingParams(temperature=1.0, seed=123)
    logits = _logits()
    a = [Verifier(0)(logits, [SpecRow([1, 2], params, 0, 5)])[0].tokens for _ in range(3)]
    b = [Verifier(99)(logits, [SpecRow([1, 2], params, 0, 5)])[0].tokens for _ in range(3)]
    assert a == b  # the request's seed, not the engine's stream
