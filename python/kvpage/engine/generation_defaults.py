"""The model's own sampling defaults (vLLM's generation_config="auto"): the temperature, top_p, top_k, min_p
and repetition_penalty its generation_config.json recommends, used wherever a request leaves them out (the
server's requests, LLM.generate / chat without SamplingParams: LLM.get_default_sampling_params).

The embedded default model's file, converted from a GGUF, recommends nothing; it gets its model card's
recommendation (SmolLM2: temperature 0.2, top_p 0.9) and the repetition penalty the 135M model needs not to
loop (1.1, the `kvpage` command's default): at OpenAI's temperature 1.0 it answers nonsense."""
from __future__ import annotations

import json
from pathlib import Path

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
EMBEDDED_MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def model_sampling_defaults(model, embedded: bool = False) -> dict:
    """The sampling fields a loaded transformers model's generation config sets explicitly: its directory's
    generation_config.json where it came from one, else its in-memory generation_config's non-default
    fields; embedded: the default model, whose missing fields EMBEDDED_MODEL_DEFAULTS fills."""
    directory = getattr(model, "name_or_path", None)  # "" for a model built in memory
    found = _from_file(Path(directory) / "generation_config.json") if directory else None
    if found is None:
        config = getattr(model, "generation_config", None)
        found = config.to_diff_dict() if config is not None else {}
    defaults = {k: found[k] for k in SAMPLING_FIELDS if found.get(k) is not None}
    return {**EMBEDDED_MODEL_DEFAULTS, **defaults} if embedded else defaults


def _from_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def fill_defaults(given: dict, defaults: dict) -> dict:
    """A request's sampling fields: those it set (not None) over the model's defaults."""
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def describe(defaults: dict) -> str:
    """One start-up line saying which defaults a request that leaves them out gets."""
    if not defaults:
        return "sampling defaults: SamplingParams' own (the model's generation config recommends none)"
    fields = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return f"sampling defaults from the model's generation config, where a request leaves them out: {fields}"
