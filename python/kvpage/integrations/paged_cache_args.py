"""The argument checks of kvpage.PagedCache: its config, pool arguments, row indices and device."""
from __future__ import annotations

import operator

import torch
from transformers import PretrainedConfig

from kvpage.model.attention import ATTN_IMPLEMENTATION


def decoder_config(config) -> PretrainedConfig:
    if not isinstance(config, PretrainedConfig):
        hint = " (pass model.config)" if hasattr(config, "config") else ""
        raise TypeError(f"config must be a transformers PretrainedConfig{hint}, got {type(config).__name__}")
    config = config.get_text_config(decoder=True)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, ATTN_IMPLEMENTATION):
        raise ValueError(f"config is for attn_implementation={implementation!r}; a PagedCache is read by the"
                         f" {ATTN_IMPLEMENTATION!r} attention: load the model with"
                         f" attn_implementation={ATTN_IMPLEMENTATION!r} (or model.set_attn_implementation)")
    layer_types = getattr(config, "layer_types", None) or ()
    others = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if others:
        raise ValueError(f"config has {others} layers; a PagedCache holds attention layers' K/V only")
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < (name != "num_hidden_layers"):
            raise ValueError(f"config must define a positive int {name} (a decoder-only LM config), got {value!r}")
    return config


def check_args(num_blocks, block_size, dtype) -> None:
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive int or None (grow on demand), got {num_blocks!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
            or block_size & (block_size - 1) or block_size > 256:
        raise ValueError(f"block_size must be a power of two up to 256, got {block_size!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")


def index_list(indices, name: str, num_rows: int) -> list[int]:
    """Row indices as ints in [0, num_rows) (as torch.index_select takes them: no bool mask, no negative index)."""
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {indices.dtype} of shape"
                             f" {tuple(indices.shape)}")
        values = indices.tolist()
    else:
        try:
            items = list(indices)
            if any(isinstance(i, bool) for i in items):
                raise TypeError
            values = [operator.index(i) for i in items]
        except TypeError:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got {indices!r}") from None
    bad = [i for i in values if not 0 <= i < num_rows]
    if bad and num_rows:
        raise ValueError(f"{name} holds {bad[:4]}, out of range for the cache's {num_rows} rows")
    return values


def as_device(device) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device must be a torch.device, a device string or None, got {device!r} ({e})") from None
