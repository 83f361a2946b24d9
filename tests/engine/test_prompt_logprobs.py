"""SamplingParams(prompt_logprobs=k): RequestOutput.prompt_logprobs against HF's log-softmax over the
prompt, through chunked prefill and beside the prefix cache, and the bad values."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import PROMPTS, check_logprob_dicts, make_llm
from kvpage import SamplingParams


@torch.inference_mode()
def hf_prompt_log_softmax(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the HF model's log-probabilities of prompt tokens 1, 2, ..."""
    return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)


def _check_prompt_logprobs(llm, hf_model, out, k: int) -> None:
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None  # nothing precedes the first token
    check_logprob_dicts(llm.tokenizer, hf_prompt_log_softmax(hf_model, prompt), prompt[1:], out.prompt_logprobs[1:], k)


def test_prompt_logprobs_are_the_models_log_softmax_and_change_no_output(llm, hf_model):
    prompts = [PROMPTS[1], PROMPTS[8], PROMPTS[6], PROMPTS[3]]
    params = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=6, prompt_logprobs=5, logprobs=2),
              SamplingParams(temperature=0, max_tokens=6)]  # a plain request in the same batch
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, sp in zip(outs[:3], params):
        _check_prompt_logprobs(llm, hf_model, out, sp.prompt_logprobs)
    assert outs[3].prompt_logprobs is None
    plain = [SamplingParams(**{**vars(sp), "prompt_logprobs": None}) for sp in params]
    again = llm.generate(prompts, plain, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outs]
    assert len(outs[2].outputs) == 2 and all(o.prompt_logprobs is None for o in again)


def test_chunked_prompts_give_them_and_are_computed_beside_the_prefix_cache(llm, hf_model):
    eng = make_llm(llm, max_num_batched_tokens=16)  # the ~70-token prompt runs in chunks of 16
    prompt = PROMPTS[11]
    asked = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    first = eng.generate(prompt, asked, use_tqdm=False)[0]
    assert len(first.prompt_token_ids) > 3 * 16
    _check_prompt_logprobs(llm, hf_model, first, 2)
    assert eng.stats()["prefix_cache_hit_tokens"] == 0
    # Its blocks went into the prefix cache: a plain request reads them there ...
    plain = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    hits = eng.stats()["prefix_cache_hit_tokens"]
    assert hits >= len(first.prompt_token_ids) // 16 * 16 - 16 and plain.outputs[0].token_ids == first.outputs[0].token_ids
    # ... while one that wants prompt logprobs computes its whole prompt again, and gets the same ones.
    again = eng.generate(prompt, asked, use_tqdm=False)[0]
    assert eng.stats()["prefix_cache_hit_tokens"] == hits
    assert again.prompt_logprobs == first.prompt_logprobs
    assert eng.stats()["kv_blocks_used"] == 0


def test_bad_prompt_logprobs_are_refused_by_name(llm):
    for value in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(beam_width=2, prompt_logprobs=1)
    params = SamplingParams(max_tokens=2)
    params.prompt_logprobs = -3  # assigned after construction: generate checks again
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(PROMPTS[1], params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
