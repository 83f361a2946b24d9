"""Exact merge of partial attention results over disjoint key sets (decode context parallelism: each
rank attends to its share of a sequence's positions, returning the log-sum-exp beside the output)."""
import torch

from kvpage.ops import _checks


def _stacked(x, name, dim):
    """A tensor of `dim` dims, or a list of tensors of dim - 1 dims stacked along a new first one."""
    if not isinstance(x, torch.Tensor):
        parts = _checks.tensor_list(x, name)
        if not parts:
            raise ValueError(f"{name} must hold at least one partial result")
        shapes = {tuple(t.shape) for t in parts}
        if len(shapes) != 1 or len({(t.dtype, t.device) for t in parts}) != 1:
            raise ValueError(f"{name}: every partial must share one shape, dtype and device, got shapes"
                             f" {sorted(shapes)}")
        x = torch.stack(parts)
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one partial result")
    return x


def merge_attention_states(outputs, lses):
    """Combines P attention results, each over its own disjoint set of keys, into attention over
    their union: out = sum_p exp(lse_p - lse) * out_p with lse = log(sum_p exp(lse_p)).

    outputs [P, T, H, D] (float32/float16/bfloat16), lses float32 [P, T, H] (as the attention ops'
    return_lse gives them), or lists of P [T, H, D] / [T, H] tensors. Computed in float32; returns
    (out [T, H, D] in outputs' dtype, lse float32 [T, H]). A partial with lse -inf saw no key: it
    weighs nothing, whatever its output holds (NaN included); a row no partial saw gets out 0 and
    lse -inf."""
    outputs = _stacked(outputs, "outputs", 4)
    lses = _stacked(lses, "lses", 3)
    if outputs.dtype not in _checks.SUPPORTED_DTYPES:
        raise TypeError(f"outputs dtype must be float32, float16 or bfloat16, got {outputs.dtype}")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses dtype must be float32, got {lses.dtype}")
    if lses.shape != outputs.shape[:3]:
        raise ValueError(f"lses shape {tuple(lses.shape)} must be outputs' [P, T, H] = {tuple(outputs.shape[:3])}")
    if lses.device != outputs.device:
        raise ValueError(f"lses is on {lses.device} but outputs is on {outputs.device}")
    lse_max = lses.amax(dim=0)
    seen = lse_max > float("-inf")
    # Shifted by the largest lse (0 where no partial saw a key) so the weights cannot overflow.
    weights = torch.exp(lses - torch.where(seen, lse_max, 0.0))  # [P, T, H]; -inf lse -> exactly 0
    total = weights.sum(dim=0)
    lse = torch.where(seen, lse_max + torch.log(total), float("-inf"))
    weights = weights / torch.where(seen, total, 1.0)
    partials = torch.where(weights[..., None] > 0, outputs.float(), 0.0)  # NaN behind a zero weight -> 0
    out = (partials * weights[..., None]).sum(dim=0)
    return out.to(outputs.dtype), lse
