"""Prompts, the HF reference and the greedy comparison shared by the engine tests."""
from __future__ import annotations

import math

import torch

import kvpage
from kvpage import SamplingParams

# Two candidate tokens whose logits differ by less than this may legitimately swap places between two
# correct fp32 implementations (different summation orders): the comparison accepts either, says so,
# and stops comparing that sequence (the paths differ from there on).
TIE_TOLERANCE = 1e-4
# The same for a bf16 model or a 16-bit cache: 8 bits of mantissa move logits by ~1e-2.
BF16_TIE_TOLERANCE = 0.1
MAX_TOKENS = 24

_SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in plain English. "
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a",
    "The three primary colours are",
    "Translate to French: I like apples.",
    "import numpy as np\nx = np.arange(10)\n",
    _SYSTEM + "What is the boiling point of water?",
    _SYSTEM + "Name a large mammal that lives in the ocean.",
    _SYSTEM + "Why is the sky blue?",
    _SYSTEM * 3 + "List three prime numbers.",
    "A long time ago " * 12 + "the end.",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "In computer science, a hash table is",
    "Water is made of",
    "Here is a haiku about autumn:\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# kvpage's log-softmax against HF's: two fp32 forward passes with different summation orders.
LOGPROB_TOLERANCE = dict(atol=5e-4, rtol=1e-5)


def make_llm(base: kvpage.LLM, **kwargs) -> kvpage.LLM:
    """Another engine configuration over the same (already loaded) weights."""
    kwargs.setdefault("num_kv_blocks", 1024)
    return kvpage.LLM(model=base.model, tokenizer=base.tokenizer, **kwargs)


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, processed: bool = False, **kwargs):
    """[(tokens, per-step logits)] from HF generate(do_sample=False), one prompt at a time (no padding).
    processed: the scores greedy chose from (after HF's logits processors: penalties, min_new_tokens)
    instead of the raw logits."""
    refs = []
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                             return_dict_in_generate=True, **{"output_scores" if processed else "output_logits": True},
                             **kwargs)
        steps = out.scores if processed else out.logits
        refs.append((out.sequences[0, len(ids):].tolist(), [lg[0].float() for lg in steps]))
    return refs


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float = 1.0,
                        presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """One row of logits, token by token: HF's repetition rule over prompt + output tokens, then vLLM's
    logit -= frequency * count + presence * (count > 0) over the output tokens."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] * repetition if out[t] < 0 else out[t] / repetition
    for t in set(output):
        out[t] -= frequency * output.count(t)
        out[t] -= presence
    return out


def assert_greedy_matches(outputs, refs, pad_token_id=None, tie_tolerance=TIE_TOLERANCE) -> int:
    """Token-for-token equality with HF, except at a near-tie (see TIE_TOLERANCE). Returns the ties."""
    ties = 0
    for k, (out, (expected, logits)) in enumerate(zip(outputs, refs)):
        got = out.outputs[0].token_ids
        if pad_token_id is not None and pad_token_id in expected:  # HF pads after eos in a batch
            expected = expected[:expected.index(pad_token_id) + 1]
        for i, (a, b) in enumerate(zip(got, expected)):
            if a != b:
                gap = (logits[i][b] - logits[i][a]).item()
                assert abs(gap) < tie_tolerance, (
                    f"prompt {k} token {i}: kvpage chose {a}, HF {b}; logit gap {gap:.3g} is no tie\n"
                    f"kvpage {got}\nHF     {expected}")
                ties += 1
                print(f"prompt {k} token {i}: near-tie (gap {gap:.2g}), accepted either token")
                break
        else:
            assert len(got) == len(expected), f"prompt {k}: kvpage {got}\nHF {expected}"
    return ties


def check_logprob_dicts(tokenizer, logp: torch.Tensor, tokens: list[int], dicts: list[dict], k: int) -> None:
    """vLLM-style {token_id: Logprob} dicts against HF's log-softmax rows logp [len(tokens), vocab]: per
    position the given token first, then the k most likely; each logprob, rank (up to near-ties) and
    decoded_token as HF's model has them."""
    tol = LOGPROB_TOLERANCE["atol"]
    assert len(dicts) == len(tokens)
    for i, (token, entries) in enumerate(zip(tokens, dicts)):
        assert next(iter(entries)) == token  # the sampled (or prompt) token first, as vLLM
        assert len(entries) in (k, k + 1)
        top = [t for t in entries if t != token or len(entries) == k]  # the k most likely
        kth = logp[i].topk(k).values[-1].item() if k else math.inf
        for t, entry in entries.items():
            expected = logp[i, t]
            torch.testing.assert_close(torch.tensor(entry.logprob), expected, **LOGPROB_TOLERANCE)
            # rank: 1 + the tokens HF makes more likely, up to the tolerance's near-ties
            assert 1 + (logp[i] > expected + tol).sum() <= entry.rank <= 1 + (logp[i] > expected - tol).sum()
            assert entry.decoded_token == tokenizer.decode([t])
            if t in top:
                assert expected >= kth - tol
        if len(entries) == k + 1:
            assert logp[i, token] <= kth + tol
