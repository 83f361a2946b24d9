"""Argument checks the C++ ops cannot express: Python types and defaults."""
import math
import operator
from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Cache dtypes: the compute dtypes, or fp8 (e4m3) holding K/V quantised with per-tensor scales.
CACHE_DTYPES = SUPPORTED_DTYPES + (torch.float8_e4m3fn,)


def require_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_positive_int(x, name):
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x <= 0:
        raise ValueError(f"{name} must be positive, got {x}")
    return x


def tensor_list(x, name):
    """A tensor or a sequence of tensors, as a list."""
    if isinstance(x, torch.Tensor):
        return [x]
    if not isinstance(x, Sequence):
        raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(x).__name__}")
    for i, t in enumerate(x):
        require_tensor(t, f"{name}[{i}]")
    return list(x)


def as_block_mapping(x, name="block_mapping"):
    """An int64 [n, 2] CPU tensor of (src, dst) from a tensor or a sequence of pairs of ints."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be an int64 [n, 2] tensor or a list of (src, dst) pairs,"
                        f" got {type(x).__name__}")
    pairs = [_block_pair(pair, f"{name}[{i}]") for i, pair in enumerate(x)]
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


def _block_pair(pair, name):
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise ValueError(f"{name} must be a (src, dst) pair of block ids, got {pair!r}")
    return [_block_id(v, name) for v in pair]


def _block_id(v, name):
    """An integer (Python or numpy, not bool): a float id would be silently truncated."""
    if isinstance(v, bool) or isinstance(v, float):
        raise TypeError(f"{name} holds {v!r}: block ids must be ints")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} holds {type(v).__name__} {v!r}: block ids must be ints") from None


# The largest float32: a softmax scale beyond it would overflow in the kernels.
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _as_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is an int beyond float range") from None


def kv_scale(value, name):
    """k_scale / v_scale as a float; the op checks its value (float32's normal range, and 1.0 unless the
    cache is fp8)."""
    return _as_float(value, name)


def default_scale(scale, head_size):
    """The softmax scale: head_size ** -0.5 by default, else any number finite in float32."""
    if scale is None:
        return head_size ** -0.5
    scale = _as_float(scale, "scale")
    if not (math.isfinite(scale) and abs(scale) <= _FLOAT32_MAX):
        raise ValueError(f"scale must be finite in float32, got {scale}")
    return scale


# The attention options: Python types here, values in the op (the C++ checks, which
# torch.ops.kvpage.* called directly runs too).


def sliding_window(value):
    """A sliding window: None or an int (not bool); the op checks it is a positive int32."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"sliding_window must be an int, got {type(value).__name__}")
    if value is not None and not -(1 << 63) <= value < (1 << 63):  # the op's schema takes int64
        raise ValueError(f"sliding_window must be a positive int32, got {value}")
    return value


def softcap(value):
    """A logit softcap: None or a number; the op checks it is positive and finite in float32."""
    return None if value is None else _as_float(value, "softcap")


def sinks(value):
    """Attention sinks: None or a tensor; the op checks float32 [num_heads] on query's device."""
    return None if value is None else require_tensor(value, "sinks")
