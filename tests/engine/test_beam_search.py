"""Beam search against HF generate(num_beams=k, do_sample=False), default early_stopping."""
from __future__ import annotations

import math
from decimal import Decimal, localcontext

import pytest
import torch

from engine_helpers import PROMPTS, make_llm
from kvpage import SamplingParams
from kvpage.engine.beam_search import length_normalised

BEAM_PROMPTS = [PROMPTS[1], PROMPTS[4], PROMPTS[13], PROMPTS[9]]


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.5)])
def test_beam_search_matches_hf(llm, hf_model, k, length_penalty):
    params = SamplingParams(beam_width=k, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.generate(BEAM_PROMPTS, params, use_tqdm=False)
    pad = hf_model.generation_config.pad_token_id
    for prompt, out in zip(BEAM_PROMPTS, outputs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=k,
                                    num_return_sequences=k, max_new_tokens=10, length_penalty=length_penalty)
        assert len(out.outputs) == k
        for beam, completion in zip(ref[:, ids.shape[1]:].tolist(), out.outputs):
            got = completion.token_ids
            assert beam[:len(got)] == got and all(t == pad for t in beam[len(got):]), (prompt, beam, got)
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("length_penalty", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_length_penalty_is_rejected(length_penalty):
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(beam_width=2, length_penalty=length_penalty)


def _exact_log(logprob: float, length: int, length_penalty: float) -> Decimal:
    """ln |logprob / length ** length_penalty| in 60-digit decimal arithmetic, free of the float range."""
    with localcontext() as ctx:
        ctx.prec = 60
        return Decimal(-logprob).ln() - Decimal(length_penalty) * Decimal(length).ln()


@pytest.mark.parametrize("length_penalty", [-1e308, -1100.0, -3.0, 0.0, 0.5, 1.0, 2.0, 1020.0, 2000.0, 1e308])
def test_the_length_normalised_score_is_exact_where_a_float_holds_it(length_penalty):
    logprobs = (-1e4, -5.0, -1e-3)
    for length in (1, 2, 7, 100):
        scores = [length_normalised(lp, length, length_penalty) for lp in logprobs]
        assert scores == sorted(scores)  # a higher logprob never scores lower
        assert length_normalised(-0.0, length, length_penalty) == 0.0
        for lp, score in zip(logprobs, scores):
            exact_log = _exact_log(lp, length, length_penalty)
            if abs(length_penalty * math.log(length)) < 700:  # HF's own arithmetic, to the bit
                assert score == lp / length ** length_penalty
            elif exact_log >= 700:  # beyond the float range: saturated, finite, still ordered
                assert score == -math.exp(700)
            elif exact_log < -745:  # below the smallest float
                assert score == 0.0
            else:
                assert math.isclose(math.log(-score), float(exact_log), rel_tol=1e-12)


@pytest.mark.parametrize("length_penalty", [-1e308, -1100.0, 2000.0, 1e308])
def test_beam_search_runs_with_any_finite_length_penalty(llm, hf_model, length_penalty):
    outs = llm.generate(BEAM_PROMPTS[:2], SamplingParams(beam_width=3, max_tokens=6, length_penalty=length_penalty),
                        use_tqdm=False)
    for prompt, out in zip(BEAM_PROMPTS, outs):
        assert len(out.outputs) == 3
        ids = llm.tokenizer.encode(prompt)
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= 6 and c.finish_reason in ("stop", "length")
            # Each beam is a real continuation: its logprob is what the model gives its tokens.
            x = torch.tensor([ids + c.token_ids])
            with torch.inference_mode():
                logp = hf_model(x).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
            expected = logp.gather(1, torch.tensor(c.token_ids).unsqueeze(1)).sum().item()
            assert math.isclose(c.cumulative_logprob, expected, abs_tol=1e-3), (prompt, c)
    assert llm.stats()["kv_blocks_used"] == 0


def _beams(outputs):
    return [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]


def test_beam_requests_run_in_the_same_steps_as_sampling_requests(llm):
    beam = SamplingParams(beam_width=3, max_tokens=6)
    sampling = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    engine = llm.llm_engine
    alone = llm.generate(BEAM_PROMPTS[:2], beam, use_tqdm=False)
    # Through LLMEngine.add_request too: a beam request reports once, finished, its beams best first.
    for i, prompt in enumerate(BEAM_PROMPTS[:2]):
        engine.add_request(f"beam{i}", prompt, beam)
    for i, prompt in enumerate(PROMPTS[5:9]):
        engine.add_request(f"sample{i}", prompt, sampling)
    done, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        mixed_steps += 1
        assert all(o.finished for o in step_outputs if o.request_id.startswith("beam"))
        done.update({o.request_id: o for o in step_outputs if o.finished})
    assert _beams([done["beam0"], done["beam1"]]) == _beams(alone)
    # One prompt step, then 6 decode steps shared by all: nothing runs one beam request after another.
    assert mixed_steps <= 8, mixed_steps
    assert llm.stats()["kv_blocks_used"] == 0


def test_beam_groups_preempted_by_recompute_or_swap_keep_their_beams(llm):
    beam = SamplingParams(beam_width=4, max_tokens=8)
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[5:9] + BEAM_PROMPTS
    params = [sampling] * 4 + [beam] * len(BEAM_PROMPTS)
    want = _beams(llm.generate(BEAM_PROMPTS, beam, use_tqdm=False))
    for mode in ("recompute", "swap"):
        small = make_llm(llm, num_kv_blocks=40, block_size=4, preemption_mode=mode, swap_space_gib=0.05)
        assert _beams(small.generate(prompts, params, use_tqdm=False)[4:]) == want, mode
        stats = small.stats()
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0, stats
