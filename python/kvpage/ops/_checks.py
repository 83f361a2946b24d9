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


# Scales the kernels hold in float32, with their reciprocals: both must stay finite and nonzero.
_FLOAT32_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def _as_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is an int beyond float range") from None


def kv_scale(value, name):
    """k_scale / v_scale: a positive number whose float32 value and reciprocal are finite and nonzero
    (the C++ checks add: 1.0 unless the cache is fp8)."""
    value = _as_float(value, name)
    if not _FLOAT32_RANGE[0] <= value <= _FLOAT32_RANGE[1]:
        raise ValueError(f"{name} must be a positive number in float32's normal range"
                         f" [{_FLOAT32_RANGE[0]:.3g}, {_FLOAT32_RANGE[1]:.3g}], got {value}")
    return value


def default_scale(scale, head_size):
    """The softmax scale: head_size ** -0.5 by default, else any number finite in float32."""
    if scale is None:
        return head_size ** -0.5
    scale = _as_float(scale, "scale")
    if not (math.isfinite(scale) and abs(scale) <= _FLOAT32_RANGE[1]):
        raise ValueError(f"scale must be finite in float32, got {scale}")
    return scale


def sliding_window(value):
    """A sliding window: None, or a positive int (a query at position p sees keys in (p - W, p])."""
    if value is None:
        return None
    require_positive_int(value, "sliding_window")
    if value > torch.iinfo(torch.int32).max:
        raise ValueError(f"sliding_window must fit in int32, got {value}")
    return value


def softcap(value):
    """A logit softcap: None, or a positive number finite in float32."""
    if value is None:
        return None
    value = _as_float(value, "softcap")
    if not (0.0 < value <= _FLOAT32_RANGE[1]):
        raise ValueError(f"softcap must be a positive number finite in float32, got {value}")
    return value


def sinks(value, query):
    """Attention sinks: None, or a float32 [num_heads] tensor on query's device."""
    if value is None:
        return None
    require_tensor(value, "sinks")
    if value.dtype != torch.float32:
        raise TypeError(f"sinks must have dtype float32, got {value.dtype}")
    num_heads = query.shape[1] if query.dim() == 3 else None
    if value.dim() != 1 or (num_heads is not None and value.shape[0] != num_heads):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got shape {tuple(value.shape)}")
    if value.device != query.device:
        raise ValueError(f"sinks must be on query's device {query.device}, got {value.device}")
    return value
