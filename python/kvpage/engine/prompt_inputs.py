"""The prompts of a generate() / chat() call as the engine takes them: vLLM's prompt forms (a string,
token ids, or a prompt dict with an optional cache salt) normalised, one SamplingParams per prompt."""
from __future__ import annotations

from dataclasses import dataclass

from .sampling_params import SamplingParams


@dataclass
class PromptItem:
    """One prompt of a generate() / chat() call: its text or ids (add_request's prompt and
    prompt_token_ids), its params and its cache salt."""

    prompt: str | list[int] | None
    token_ids: list[int] | None
    params: SamplingParams
    cache_salt: str | None = None


_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def normalise_prompts(prompts) -> list[tuple]:
    """(prompt, prompt_token_ids, cache_salt) per prompt: strings, token-id lists, and vLLM's prompt
    dicts, {"prompt": text} or {"prompt_token_ids": ids}, each with an optional "cache_salt"."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]  # a single prompt of token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a non-empty list of strings or a list of token-id lists")
    return [_normalise_prompt(i, p) for i, p in enumerate(prompts)]


def _normalise_prompt(i: int, p) -> tuple:
    if isinstance(p, (str, list, tuple)):
        return p, None, None
    if not isinstance(p, dict):
        raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a prompt dict, got {type(p).__name__}")
    if set(p) - _PROMPT_KEYS or not {"prompt", "prompt_token_ids"} & set(p):
        raise ValueError(f"prompts[{i}] must be a dict of 'prompt' (text) or 'prompt_token_ids', and optionally"
                         f" 'cache_salt'; got keys {sorted(p)}")
    text, ids = p.get("prompt"), p.get("prompt_token_ids")
    if (text is not None and not isinstance(text, str)) or (ids is not None and not isinstance(ids, (list, tuple))):
        raise ValueError(f"prompts[{i}]: 'prompt' must be a string and 'prompt_token_ids' a list of token ids")
    if ids is not None:  # a text beside the ids is only reported back, as in vLLM
        return text, list(ids), p.get("cache_salt")
    return text, None, p.get("cache_salt")


def per_prompt_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        return list(sampling_params)
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
