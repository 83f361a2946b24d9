"""The sampler's penalties, min_p, min_tokens and logprobs on hand-made logits and token histories (no
model), against references written out here one token at a time, and the bad values of every option."""
from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import reference_penalties
from kvpage import SamplingParams
from kvpage.engine import Sampler, SampleRow
from kvpage.engine import sampler as sampler_module
from kvpage.engine.logits_processors import apply_logits_processors

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


HISTORIES = [  # (prompt, output, repetition, presence, frequency)
    ([1, 2, 3, 3], [5, 5, 5, 9], 1.3, 0.0, 0.0),
    ([4], [4, 7, 7], 1.0, 0.8, 0.0),
    ([10, 11], [11, 12, 12, 12, 40], 1.0, 0.0, 1.5),
    ([0, 63], [63, 1, 1, 2], 0.7, -0.5, 2.0),  # a penalty < 1 and a negative presence reward seen tokens
    ([20, 21], [], 1.5, 2.0, -2.0),  # no output yet: only the repetition penalty acts
]


def _rows(params_for, histories=HISTORIES) -> list[SampleRow]:
    return [SampleRow(params_for(rep, pres, freq), prompt_token_ids=prompt, output_token_ids=output)
            for prompt, output, rep, pres, freq in histories]


def _penalised(rep, pres, freq, **kw):
    return SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, **kw)


def test_penalties_equal_the_token_by_token_reference():
    logits = _logits(len(HISTORIES) + 1)
    rows = _rows(_penalised) + [SampleRow(SamplingParams())]  # a plain row in the batch stays as it is
    got = apply_logits_processors(logits.clone(), rows)
    for i, (prompt, output, rep, pres, freq) in enumerate(HISTORIES):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], prompt, output, rep, pres, freq))
    assert torch.equal(got[-1], logits[-1])


def test_greedy_rows_take_the_argmax_of_the_penalised_logits_and_report_the_models_logprobs():
    logits = _logits(len(HISTORIES), seed=1)
    # Make each row's argmax a token its penalty hits, so the penalty must change the choice.
    for i, (prompt, output, *_ ) in enumerate(HISTORIES):
        logits[i, (output or prompt)[0]] = 8.0
    out = Sampler()(logits, _rows(lambda r, p, f: _penalised(r, p, f, temperature=0)))
    logp = logits.log_softmax(-1)
    for i, (prompt, output, rep, pres, freq) in enumerate(HISTORIES):
        expected = int(reference_penalties(logits[i], prompt, output, rep, pres, freq).argmax())
        assert out.tokens[i] == [expected]
        assert math.isclose(out.logprobs[i][0], logp[i, expected].item(), abs_tol=1e-5)
    assert any(t != [int(logits[i].argmax())] for i, t in enumerate(out.tokens))


def test_seeded_sampling_with_penalties_draws_what_it_draws_from_the_penalised_logits():
    # A seeded row's noise depends on (seed, sample, position) only, so sampling with a penalty must
    # equal sampling, without one, from logits the reference penalised: the same token, every time.
    logits = _logits(len(HISTORIES), seed=2)
    for seed in range(20):
        kw = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=seed)
        got = Sampler()(logits, _rows(lambda r, p, f: _penalised(r, p, f, **kw)))
        ref = torch.stack([reference_penalties(logits[i], *h) for i, h in enumerate(HISTORIES)])
        want = Sampler()(ref, [SampleRow(SamplingParams(**kw))] * len(HISTORIES))
        assert got.tokens == want.tokens


def _support(params: SamplingParams, logits: torch.Tensor, draws: int = 400) -> set[int]:
    sampler = Sampler(seed=0)
    return {sampler(logits, [SampleRow(params)]).tokens[0][0] for _ in range(draws)}


def _reference_support(probs: list[float], min_p: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> set[int]:
    """vLLM's order written out, for probabilities sorted best first: min-p on the distribution, then
    top-k, then top-p on what is left, renormalised."""
    kept = [t for t, p in enumerate(probs) if p >= min_p * max(probs)]
    if top_k:
        kept = kept[:top_k]
    total = sum(probs[t] for t in kept)
    mass_before = [sum(probs[u] for u in kept[:i]) / total for i in range(len(kept))]
    return {t for t, before in zip(kept, mass_before) if before < top_p}


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    # probabilities 0.4, 0.2, 0.15, 0.1, 0.08, 0.07: min_p=0.3 keeps p >= 0.12 (the first three).
    probs = [0.4, 0.2, 0.15, 0.1, 0.08, 0.07]
    logits = torch.log(torch.tensor([probs]))
    # (0.2, top_p=0.62): top-p measured after min-p keeps {0, 1} (0.4 + 0.2 is 0.645 of the 0.93 left);
    # measured before it, as HF and vLLM v0 order them, it would keep {0, 1, 2}.
    for min_p, kw in ((0.3, {}), (0.45, {}), (1.0, {}), (0.3, dict(top_k=2)), (0.2, dict(top_p=0.62)),
                      (0.1, dict(top_k=4, top_p=0.8))):
        expected = _reference_support(probs, min_p, **kw)
        assert _support(SamplingParams(min_p=min_p, **kw), logits) == expected, (min_p, kw)
    assert _reference_support(probs, 0.2, top_p=0.62) == {0, 1}
    # After temperature: at T=2 the ratios are square roots, so min_p=0.3 keeps p / 0.4 >= 0.09 (all).
    for min_p in (0.3, 0.6):
        soft = [p ** 0.5 / sum(q ** 0.5 for q in probs) for p in probs]
        assert _support(SamplingParams(min_p=min_p, temperature=2.0), logits) == _reference_support(soft, min_p)
    assert _reference_support([p ** 0.5 for p in probs], 0.3) == set(range(6))


def test_min_tokens_holds_back_the_stop_tokens_until_enough_output():
    logits = _logits(3, seed=3)
    stops = tuple(int(t) for t in logits[0].topk(2).indices)  # the two most likely tokens of row 0
    logits[1:] = logits[0]
    params = SamplingParams(temperature=0, min_tokens=4, max_tokens=8)
    rows = [SampleRow(params, position=0, stop_token_ids=stops), SampleRow(params, position=3, stop_token_ids=stops),
            SampleRow(params, position=4, stop_token_ids=stops)]
    out = Sampler()(logits, rows)
    third = int(logits[0].topk(3).indices[2])
    assert out.tokens == [[third], [third], [stops[0]]]  # position 4 = min_tokens: stops allowed again
    # Sampling never draws them either, and their logprobs stay the model's.
    sampled = Sampler(seed=0)(logits[:1].expand(300, -1), [SampleRow(SamplingParams(min_tokens=2, max_tokens=4),
                                                                     stop_token_ids=stops)] * 300)
    assert not {t[0] for t in sampled.tokens} & set(stops)


def test_logprobs_hold_the_sampled_token_and_the_top_k_of_the_models_distribution():
    logits = _logits(4, seed=4)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # a tie for first place: both rank 1
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=3)),
            SampleRow(SamplingParams(temperature=1.5, seed=0, logprobs=0)),
            SampleRow(SamplingParams(temperature=0, logprobs=4)),
            SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2),
                      prompt_token_ids=[int(logits[3].argmax())], output_token_ids=[])]
    out = Sampler()(logits, rows)
    assert out.top_logprobs is not None
    logp = logits.log_softmax(-1)
    for i, (row, tokens, lps, tops) in enumerate(zip(rows, out.tokens, out.logprobs, out.top_logprobs)):
        top, token = tops[0], tokens[0]
        k = row.params.logprobs
        values, ids = logp[i].topk(k)
        assert sorted(top.token_ids) == sorted(ids.tolist()) and top.token_ids == sorted(
            top.token_ids, key=lambda t: -logp[i, t].item())
        torch.testing.assert_close(torch.tensor(top.logprobs), values)
        assert top.ranks == [1 + int((logp[i] > v).sum()) for v in values]
        assert lps[0] == pytest.approx(logp[i, token].item(), abs=1e-6)
        assert top.rank == 1 + int((logp[i] > logp[i, token]).sum())
    assert out.top_logprobs[2][0].ranks[:2] == [1, 1]
    assert out.top_logprobs[3][0].rank == 2  # the penalty moved greedy off the model's favourite


def test_a_plain_greedy_batch_takes_the_fused_path_and_nothing_else(monkeypatch):
    calls = []
    for name in ("greedy_sample", "apply_logits_processors", "_logprobs", "_min_p"):
        def spy(*args, _name=name, _original=getattr(sampler_module, name)):
            calls.append(_name)
            return _original(*args)
        monkeypatch.setattr(sampler_module, name, spy)
    # min_tokens already reached (the engine then passes no stop ids), or a penalty at its default.
    plain = [SampleRow(SamplingParams(temperature=0)),
             SampleRow(SamplingParams(temperature=0, min_tokens=2, max_tokens=4), position=2),
             SampleRow(SamplingParams(temperature=0, repetition_penalty=1.0, min_p=0.5))]
    Sampler()(_logits(3), plain)
    assert calls == ["greedy_sample"]
    for row, expected in ((SampleRow(SamplingParams(temperature=0, logprobs=0)), ["_logprobs"]),
                          (SampleRow(SamplingParams(temperature=0, frequency_penalty=0.1), output_token_ids=[1]),
                           ["apply_logits_processors", "_logprobs"]),
                          (SampleRow(SamplingParams(temperature=0, min_tokens=1, max_tokens=4), stop_token_ids=(3,)),
                           ["apply_logits_processors", "_logprobs"])):
        calls.clear()
        Sampler()(_logits(4), plain + [row])
        assert calls == expected, row


def test_a_penalised_row_without_its_history_is_an_error():
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(_logits(1), [SampleRow(SamplingParams(presence_penalty=0.5))])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler()(_logits(1), [SampleRow(SamplingParams(repetition_penalty=1.1), output_token_ids=[])])


@pytest.mark.parametrize("name,value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")), ("repetition_penalty", "1.2"), ("repetition_penalty", True),
    ("repetition_penalty", 1e300), ("repetition_penalty", 1e-300),  # inf / 0 in float32, where logits live
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("nan")),
    ("presence_penalty", None), ("frequency_penalty", 3.0), ("frequency_penalty", float("-inf")),
    ("frequency_penalty", "0"), ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", False),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True), ("min_tokens", 17),  # > max_tokens=16
    ("logprobs", -1), ("logprobs", 2.0), ("logprobs", True), ("logprobs", "5"),
    ("include_stop_str_in_output", 1), ("include_stop_str_in_output", "yes"),
    ("prompt_logprobs", -1), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("inf")}), ("logit_bias", {3: -1e300}),
    ("logit_bias", {"3": 1.0}),
    ("logit_bias", [(3, 1.0)]), ("logit_bias", {3: "1"}), ("allowed_token_ids", []), ("allowed_token_ids", [-2]),
    ("allowed_token_ids", 5), ("allowed_token_ids", [1.0]), ("skip_special_tokens", 0), ("bad_words", [""]),
    ("bad_words", [3]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", 2.0),
])
def test_bad_values_of_the_new_options_name_them(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value", [("repetition_penalty", 1.2), ("presence_penalty", 0.5),
                                        ("frequency_penalty", -0.5), ("min_p", 0.1), ("min_tokens", 2),
                                        ("logprobs", 0), ("stop", "\n"), ("logit_bias", {1: 2.0}),
                                        ("allowed_token_ids", [1, 2]), ("bad_words", ["no"])])
def test_beam_search_refuses_the_logits_options(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(beam_width=2, **{name: value})
    params = SamplingParams(beam_width=2)
    setattr(params, name, value)  # assigned after construction: validate() (run again by generate) refuses it
    with pytest.raises(ValueError, match=name):
        params.validate()


def test_edge_values_are_accepted():
    SamplingParams(repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2.0, min_p=1, min_tokens=16,
                   logprobs=0, include_stop_str_in_output=True)
    SamplingParams(beam_width=3, include_stop_str_in_output=True)


@pytest.mark.parametrize("penalty", [3.4e38, 1.2e-38])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_extreme_repetition_penalty_keeps_to_the_allowed_tokens(penalty, temperature):
    """Penalties at float32's ends overflow a seen logit (to -inf or inf, the row's softmax to nan);
    the penalised logit stays finite, so the row still samples an allowed token, never a masked one."""
    logits = _logits(1, seed=9)
    logits[0, 39], logits[0, 7] = -2.0, 5.0  # both seen: the penalty pushes 39 down and 7 up (or the reverse)
    params = SamplingParams(temperature=temperature, seed=1, allowed_token_ids=[7, 39], repetition_penalty=penalty)
    rows = [SampleRow(params, prompt_token_ids=[39, 7], output_token_ids=[39])]
    got = apply_logits_processors(logits.clone(), rows)
    assert bool(got[0, [7, 39]].isfinite().all()) and bool((got[0].isinf() == ~torch.isin(torch.arange(VOCAB),
                                                                                             torch.tensor([7, 39]))).all())
    for _ in range(5):
        assert Sampler()(logits.clone(), rows).tokens[0][0] in (7, 39)


def test_allowed_token_ids_then_logit_bias_come_first_in_vllms_order():
    # With a repetition penalty after them: (logit + bias) / penalty, not logit / penalty + bias.
    logits = _logits(2, seed=7)
    allowed, bias = [3, 9, 20, 41], {9: 2.5, 41: -1.0, 50: 4.0}  # 50: biased but not allowed
    params = SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias=bias, repetition_penalty=1.7)
    rows = [SampleRow(params, prompt_token_ids=[9, 41], output_token_ids=[3]), SampleRow(SamplingParams())]
    got = apply_logits_processors(logits.clone(), rows)
    ref = torch.full((VOCAB,), float("-inf"))
    ref[allowed] = logits[0, allowed]
    for t, b in bias.items():
        ref[t] += b
    torch.testing.assert_close(got[0], reference_penalties(ref, [9, 41], [3], 1.7))
    assert torch.equal(got[1], logits[1])
    out = Sampler()(logits[:1], rows[:1])
    assert out.tokens == [[int(got[0].argmax())]]
    # The reported logprob is the model's own, before the bias and the mask.
    assert math.isclose(out.logprobs[0][0], logits[0].log_softmax(-1)[out.tokens[0][0]].item(), abs_tol=1e-5)


def test_sampling_draws_only_allowed_tokens_and_a_large_bias_wins():
    logits = _logits(1, seed=8)
    assert _support(SamplingParams(temperature=1.5, allowed_token_ids=[5, 6, 60]), logits) == {5, 6, 60}
    assert _support(SamplingParams(temperature=1.0, logit_bias={17: 100.0}), logits) == {17}
    greedy = SamplingParams(temperature=0, logit_bias={int(logits[0].argmin()): 1e4})
    assert Sampler()(logits, [SampleRow(greedy)]).tokens == [[int(logits[0].argmin())]]


def test_token_ids_outside_the_vocabulary_are_named():
    for params in (SamplingParams(allowed_token_ids=[3, VOCAB]), SamplingParams(logit_bias={VOCAB + 5: 1.0})):
        with pytest.raises(ValueError, match="allowed_token_ids|logit_bias"):
            Sampler()(_logits(1), [SampleRow(params)])
