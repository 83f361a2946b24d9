"""What LLM(...) resolves from its arguments and the model's config before the engine starts: the
dtype, the sampling seed, the tokenizer, the context limit and the eos ids."""
from __future__ import annotations

import logging
import os
import secrets

import torch

from .sampling_params import check_seed

logger = logging.getLogger("kvpage")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


def resolve_seed(seed) -> int:
    """The engine-wide sampling seed: an int (the same workload gives the same tokens), or None for a fresh
    random one per LLM (vLLM's seed=None)."""
    if seed is None:
        return secrets.randbits(63)
    check_seed(seed)
    return seed


def resolve_tokenizer(tokenizer):
    """None (the model's own), a local tokenizer directory, or an object with encode and decode."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        if not os.path.isdir(tokenizer):
            raise ValueError(f"tokenizer must be None, a local tokenizer directory or a tokenizer object;"
                             f" {str(tokenizer)!r} is no directory")
        from transformers import AutoTokenizer
        try:  # local only: a typo must not turn into a download
            return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer: no tokenizer could be loaded from {str(tokenizer)!r}: {e}") from e
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer must be None, a local tokenizer directory or an object with encode and"
                        f" decode methods, got {type(tokenizer).__name__}")
    return tokenizer


def resolve_dtype(dtype):
    # Checked before the model loads: a model object is converted in place (model.to), so a dtype the
    # kernels cannot take must not reach it.
    if dtype is None or dtype == "auto":  # vLLM's spelling of "as the model has it"
        return None
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype must be None, 'auto', torch.float32 / float16 / bfloat16 or one of {sorted(_DTYPES)},"
                     f" got {dtype!r}")


def max_model_len(config) -> int | None:
    """The model's context, max_position_embeddings: sliding-window layers attend within their window
    in the kernels (layer_sliding_windows), so the window is no cap on the sequence."""
    layer_sliding_windows(config)  # a layer type kvpage cannot run is refused before anything loads
    return getattr(config, "max_position_embeddings", None)


# Families whose attention layers all take config.sliding_window (their modeling code passes
# sliding_window=getattr(self.config, "sliding_window", None) to every layer and ignores layer_types).
UNIFORM_WINDOW_TYPES = ("mistral", "mixtral", "phi3", "starcoder2", "olmoe", "minimax", "ministral3")
LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_sliding_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (a query at p reads keys in (p - W, p]), None for full attention.

    As HF's modeling code decides it: Mistral-like families apply config.sliding_window to every layer;
    the others (Gemma 2 / 3, Qwen2 with use_sliding_window, whose config turns max_window_layers into
    layer_types, gpt-oss, Cohere2, ...) to the layers config.layer_types calls "sliding_attention".
    A layer type kvpage has no kernel for (chunked, linear attention, ...) raises NotImplementedError."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = config.num_hidden_layers
    window = _window_of(config)
    layer_types = getattr(config, "layer_types", None)
    if getattr(config, "model_type", None) in UNIFORM_WINDOW_TYPES or layer_types is None:
        return [window] * num_layers
    others = sorted(set(layer_types) - set(LAYER_TYPES))
    if others:
        raise NotImplementedError(f"{config.model_type} has {others} layers: kvpage's paged attention runs"
                                  f" {list(LAYER_TYPES)} layers only")
    if len(layer_types) < num_layers:
        raise ValueError(f"config.layer_types names {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]


def _window_of(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    # Qwen2-MoE writes 0 for "no window" (Qwen2 writes None) when use_sliding_window is off.
    if window is None or window == 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"config.sliding_window must be a positive int or None, got {window!r}")
    return window


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The generation config's eos ids (HF generate stops on all of them), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)  # a minimal encode/decode tokenizer may have none
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
