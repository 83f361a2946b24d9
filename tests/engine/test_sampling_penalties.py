"""vLLM's logits options end to end on the default model: repetition_penalty and min_tokens against HF
generate, presence/frequency penalties against a greedy loop over the HF model written here, logprobs
against the HF model's log-softmax, and stop strings under min_tokens / include_stop_str_in_output."""
from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import PROMPTS, assert_greedy_matches, check_logprob_dicts, hf_generate, reference_penalties
from kvpage import SamplingParams
from kvpage.engine import Sampler, SampleRow

# Prompts that repeat themselves, where a repetition penalty changes greedy output.
REPEATING = [PROMPTS[3], PROMPTS[12], PROMPTS[14], PROMPTS[1]]
# kvpage's and HF's fp32 log-probabilities differ by the logits' summation order (kvpage's kernels vs
# sdpa): up to 5.5e-5 over 8 prompts x 16 sampled tokens x 6 entries here; the bound leaves ~10x.
def hf_processed(model, prompts: list[list[int]], max_new_tokens: int, **kwargs):
    """HF generate's tokens and the processed scores greedy chose from (assert_greedy_matches' near-tie check)."""
    return hf_generate(model, prompts, max_new_tokens, processed=True, **kwargs)


@torch.inference_mode()
def hf_log_softmax(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: the HF model's log-probabilities at each output position."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return logits.float().log_softmax(dim=-1)


def test_greedy_repetition_penalty_matches_hf(llm, hf_model, hf_greedy):
    ids = [llm.tokenizer.encode(p) for p in REPEATING]
    penalised = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0, max_tokens=24)  # hf_greedy's length
    # Plain requests share the batch: the penalty must not reach them.
    outs = llm.generate(REPEATING * 2, [penalised] * 4 + [plain] * 4, use_tqdm=False)
    assert_greedy_matches(outs[:4], hf_processed(hf_model, ids, 16, repetition_penalty=1.3))
    assert_greedy_matches(outs[4:], [hf_greedy[PROMPTS.index(p)] for p in REPEATING])
    changed = [a.outputs[0].token_ids != b.outputs[0].token_ids[:len(a.outputs[0].token_ids)]
               for a, b in zip(outs[:4], outs[4:])]
    assert sum(changed) >= 2, changed  # the penalty did change greedy output


def _chat_ids(llm, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_min_tokens_matches_hf_min_new_tokens(llm, hf_model):
    eos = llm.tokenizer.eos_token_id
    ids = _chat_ids(llm, "What is 2+2?")
    short = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    min_tokens = len(short.token_ids) + 2  # past the answer's eos, with tokens left before max_tokens
    assert short.token_ids[-1] == eos and min_tokens < 16, short
    # By eos, then by a stop token id: the model's first choice of token 2 of a fibonacci body.
    code = llm.tokenizer.encode(PROMPTS[2])
    first = llm.generate([code], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    stop_id = first.token_ids[1]
    outs = llm.generate([ids, code], [SamplingParams(temperature=0, max_tokens=16, min_tokens=min_tokens),
                                      SamplingParams(temperature=0, max_tokens=16, min_tokens=6,
                                                     stop_token_ids=[stop_id])], use_tqdm=False)
    refs = hf_processed(hf_model, [ids], 16, min_new_tokens=min_tokens)
    refs += hf_processed(hf_model, [code], 16, min_new_tokens=6, eos_token_id=[eos, stop_id])
    assert_greedy_matches(outs, refs)
    for out, m, stops in ((outs[0], min_tokens, {eos}), (outs[1], 6, {eos, stop_id})):
        tokens = out.outputs[0].token_ids
        assert len(tokens) > m and not set(tokens[:m]) & stops, tokens
        assert out.outputs[0].finish_reason == ("stop" if tokens[-1] in stops else "length")


class _HFStepper:
    """The HF model one token at a time on its own KV cache (a DynamicCache it fills in place)."""

    def __init__(self, model, prompt: list[int]) -> None:
        from transformers import DynamicCache

        self.model, self.cache, self.pending = model, DynamicCache(), list(prompt)

    @torch.inference_mode()
    def next_logits(self, token: int | None = None) -> torch.Tensor:
        """[1, vocab] logits after the prompt (first call) or after `token`."""
        ids = self.pending + ([] if token is None else [token])
        self.pending = []
        # The cache goes by position: transformers 5.x renames the argument (past_key_values -> cache).
        return self.model(torch.tensor([ids]), None, None, self.cache, use_cache=True).logits[0, -1:].float()


def _greedy_loop(model, prompt: list[int], max_new_tokens: int, eos: int, **penalties):
    """Greedy decoding written out over the HF model: the penalties of
    engine_helpers.reference_penalties, then argmax. [(tokens, per-step scores)] as hf_processed."""
    stepper, output, scores = _HFStepper(model, prompt), [], []
    for _ in range(max_new_tokens):
        logits = stepper.next_logits(output[-1] if output else None)[0]
        scores.append(reference_penalties(logits, prompt, output, **penalties))
        output.append(int(scores[-1].argmax()))
        if output[-1] == eos:
            break
    return output, scores


@pytest.mark.parametrize("penalties", [dict(presence=0.6, frequency=0.4),
                                       dict(repetition=1.2, presence=-0.3, frequency=0.8)],
                         ids=["presence_frequency", "all_three"])
def test_presence_and_frequency_penalties_match_a_greedy_loop_over_hf(llm, hf_model, hf_greedy, penalties):
    prompts = [PROMPTS[3], PROMPTS[16]]
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=penalties.get("repetition", 1.0),
                            presence_penalty=penalties["presence"], frequency_penalty=penalties["frequency"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    eos = llm.tokenizer.eos_token_id
    assert_greedy_matches(outs, [_greedy_loop(hf_model, o.prompt_token_ids, 16, eos, **penalties) for o in outs])
    plain = [hf_greedy[PROMPTS.index(p)][0] for p in prompts]
    assert any(o.outputs[0].token_ids != g[:len(o.outputs[0].token_ids)] for o, g in zip(outs, plain))


def test_each_of_n_samples_is_penalised_by_its_own_tokens(llm, hf_model):
    # Seeded draws depend on (seed, sample, position, logits) only, so the reference steps the sampler
    # itself over HF's logits with each sample's own history: what the engine must hand it.
    # (Penalties this strong make one sample's tokens differ if it were given another's history.)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True,
                            presence_penalty=1.5, frequency_penalty=1.5)
    out = llm.generate(PROMPTS[4], params, use_tqdm=False)[0]
    prompt = out.prompt_token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        stepper = _HFStepper(hf_model, prompt)
        for position in range(len(c.token_ids)):
            history = c.token_ids[:position]
            logits = stepper.next_logits(history[-1] if history else None)
            row = SampleRow(params, sample_index=c.index, position=position, prompt_token_ids=prompt,
                            output_token_ids=history)
            assert Sampler()(logits, [row]).tokens == [[c.token_ids[position]]], (c.index, position)


def _check_logprobs(llm, hf_model, out, k: int) -> None:
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    logp = hf_log_softmax(hf_model, out.prompt_token_ids, c.token_ids)
    check_logprob_dicts(llm.tokenizer, logp, c.token_ids, c.logprobs, k)
    # cumulative_logprob sums the same numbers the dicts hold.
    assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                        abs_tol=1e-9)


def test_logprobs_are_the_models_log_softmax(llm, hf_model):
    prompts = [PROMPTS[1], PROMPTS[6], PROMPTS[3]]
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=5),
              SamplingParams(temperature=0.9, seed=3, max_tokens=8, logprobs=3, top_k=20, ignore_eos=True),
              # penalised and low-temperature sampling: still the model's distribution, before both
              SamplingParams(temperature=0.5, seed=4, max_tokens=8, logprobs=0, repetition_penalty=1.5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, sp in zip(outs, params):
        _check_logprobs(llm, hf_model, out, sp.logprobs)
    assert all(e[t].rank == 1 for t, e in zip(outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs))
    plain = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.token_ids == outs[0].outputs[0].token_ids


def test_stop_strings_with_min_tokens_and_include_stop_str_in_output(llm):
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm.generate(PROMPTS[2], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    stop = base.text[10:14]
    kept = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    end = base.text.index(stop) + len(stop)
    assert kept.finish_reason == "stop" and kept.text == base.text[:end], (kept.text, stop)
    # A stop string that the first three tokens complete, and never again: min_tokens past those
    # tokens lets it go by, so the output runs to its length.
    early = llm.tokenizer.decode(base.token_ids[:3], skip_special_tokens=True)
    stops = [early[i:i + n] for n in (4, 3, 2) for i in range(len(early) - n + 1)]
    stop = next(s for s in stops if base.text.count(s) == 1 and s not in llm.tokenizer.decode(base.token_ids[:2]))
    cut = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop=stop), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) == 3
    held = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop=stop, min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "length" and held.token_ids == base.token_ids and held.text == base.text
    # min_tokens=3: the third token is the min_tokens-th, so its stop string counts (vLLM's StopChecker).
    at = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop=stop, min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert at.token_ids == cut.token_ids and at.text == cut.text


def test_mutated_params_are_checked_again_by_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    for name, value in (("min_p", 2.0), ("logprobs", -3), ("min_tokens", 5), ("presence_penalty", 9.0)):
        setattr(params, name, value)
        with pytest.raises(ValueError, match=name):
            llm.generate(PROMPTS[1], params, use_tqdm=False)
        setattr(params, name, SamplingParams.__dataclass_fields__[name].default)
    assert llm.stats()["kv_blocks_used"] == 0
