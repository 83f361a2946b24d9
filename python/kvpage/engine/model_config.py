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
    """The model's context, capped at its sliding window where it has one: the kernels attend over
    the whole sequence, which equals windowed attention only while a sequence fits in the window, so
    a longer request is refused up front (add_request) rather than failing mid-generation."""
    limit = getattr(config, "max_position_embeddings", None)
    window = sliding_window(config)
    if window is not None and (limit is None or window < limit):
        logger.info("kvpage: max_model_len capped at the model's sliding window of %d tokens", window)
        return window
    return limit


def sliding_window(config) -> int | None:
    """The sliding window some layer of this model attends within, or None (Mistral sets one; Qwen2 only
    with use_sliding_window; layer_types, where present, says whether any layer uses it)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The generation config's eos ids (HF generate stops on all of them), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)  # a minimal encode/decode tokenizer may have none
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
