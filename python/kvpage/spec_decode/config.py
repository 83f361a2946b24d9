"""speculative_config (vLLM's names): which proposer, how many tokens it proposes per step.

Pure Python (no torch): the command line parses `--speculative-config '{...}'` with it before the model loads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# Every key each method takes; anything else is refused by name (a typo must not silently disable speculation).
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"method", "num_speculative_tokens", "model"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: object = None  # draft_model: a local HF model directory (or a PreTrainedModel, from Python)


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a dict or its JSON text -> SpeculativeConfig; ValueError naming the offending key otherwise."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
    unknown = sorted(set(value) - _KEYS[method])
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} for method {method!r}"
                         f" (it takes {sorted(_KEYS[method])})")
    k = _positive_int(value, "num_speculative_tokens", None)
    if method == "ngram":
        lo = _positive_int(value, "prompt_lookup_min", 1)
        hi = _positive_int(value, "prompt_lookup_max", max(lo, 4))
        if lo > hi:
            raise ValueError(f"speculative_config['prompt_lookup_min']={lo} exceeds prompt_lookup_max={hi}")
        return SpeculativeConfig(method, k, lo, hi)
    model = value.get("model")
    if model is None or (isinstance(model, str) and not model):
        raise ValueError("speculative_config['model'] is required for method 'draft_model': a local HF model"
                         " directory of a smaller model with the target's tokenizer")
    return SpeculativeConfig(method, k, model=model)


def _positive_int(value: dict, key: str, default: int | None) -> int:
    if key not in value:
        if default is None:
            raise ValueError(f"speculative_config['{key}'] is required (a positive int)")
        return default
    v = value[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"speculative_config['{key}'] must be a positive int, got {v!r}")
    return v


def speculative_config_arg(text: str) -> dict:
    """argparse type for --speculative-config: the JSON checked at parse time, so the error names the flag."""
    import argparse
    try:
        parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)
