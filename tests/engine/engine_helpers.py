"""Prompts, the HF reference and the greedy comparison shared by the engine tests."""
from __future__ import annotations

import torch

import kvpage
from kvpage import SamplingParams

# Two candidate tokens whose logits differ by less than this may legitimately swap places between two
# correct fp32 implementations (different summation orders): the comparison accepts either, says so,
# and stops comparing that sequence (the paths differ from there on).
TIE_TOLERANCE = 1e-4
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
        x = torch.tensor([ids])
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
