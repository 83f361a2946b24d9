"""Argument checks the C++ ops cannot express: Python types and defaults."""
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
    """An int64 [n, 2] CPU tensor of (src, dst) from a tensor or a sequence of pairs."""
    if isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, Sequence):
        raise TypeError(f"{name} must be an int64 [n, 2] tensor or a list of (src, dst) pairs")
    mapping = torch.tensor(list(x), dtype=torch.int64)
    return mapping.reshape(-1, 2) if mapping.numel() == 0 else mapping


def kv_scale(value, name):
    """k_scale / v_scale: a positive finite number (the C++ checks add: 1.0 unless the cache is fp8)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return float(value)


def default_scale(scale, head_size):
    if scale is None:
        return head_size ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    return float(scale)
