"""Loads the compiled extension (which registers torch.ops.kvpage.*) and its fake kernels.

Every op mutates its outputs in place and returns nothing, so the fake kernels (what torch.compile
traces, and what a call with any 'meta' tensor dispatches to) compute nothing; they only repeat the
device checks, because such a call never reaches the C++ ones, and refuse meta tensors mixed with
real ones (the call would silently leave the real ones untouched)."""
import torch
from torch._subclasses.fake_tensor import FakeTensor

from kvpage import _C  # noqa: F401  (importing registers the ops)

OPS = ("reshape_and_cache", "paged_attention", "paged_prefill_attention", "copy_blocks", "swap_blocks",
       "rms_norm", "silu_and_mul", "greedy_sample")
# Arguments that may sit on another device than the rest: swap moves between devices, and the
# block mapping is always read on the host.
_OWN_DEVICE_ARGS = {"src", "dst", "block_mapping"}
# Everything is compared against the cache, like the C++ checks; out last, since it usually
# follows query (torch.empty_like) and the message should name the input.
_ANCHORS = ("key_cache", "key_caches", "input", "gate", "logits")


def _same_device(pairs, what):
    """pairs: (name, tensor); raises ValueError naming the first tensor off the first one's device."""
    pairs = list(pairs)
    for name, tensor in pairs[1:]:
        if tensor.device != pairs[0][1].device:
            raise ValueError(f"{name} is on {tensor.device} but {pairs[0][0]} is on {pairs[0][1].device}"
                             f" ({what} must share a device)")


def _tensors(name, value):
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return []


def _no_meta_with_real(pairs):
    """A call mixing meta tensors with real (not fake) ones would do nothing to the real ones."""
    meta = next((name for name, t in pairs if t.device.type == "meta"), None)
    real = next((name for name, t in pairs if t.device.type != "meta" and not isinstance(t, FakeTensor)), None)
    if meta is not None and real is not None:
        raise ValueError(f"{meta} is a meta tensor but {real} holds data: a kvpage op with meta tensors computes"
                         f" nothing, so all of its tensors must be meta (or fake)")


def _make_fake(op_name):
    arg_names = [a.name for a in getattr(torch.ops.kvpage, op_name).default._schema.arguments]

    def fake(*args, **kwargs):
        named = {**dict(zip(arg_names, args)), **kwargs}
        order = sorted(named, key=lambda n: (n not in _ANCHORS, n == "out"))
        shared = [p for n in order if n not in _OWN_DEVICE_ARGS for p in _tensors(n, named[n])]
        _same_device(shared, "these tensors")
        for name in ("src", "dst"):
            _same_device(_tensors(name, named.get(name)), f"the tensors of {name}")
        mapping = named.get("block_mapping")
        if mapping is not None and mapping.device.type != "cpu":
            raise ValueError("block_mapping must be a CPU tensor")
        _no_meta_with_real([p for n in arg_names if n != "block_mapping" for p in _tensors(n, named.get(n))])

    return fake


for _name in OPS:
    torch.library.register_fake(f"kvpage::{_name}")(_make_fake(_name))

ops = torch.ops.kvpage
cpu_isa = _C.cpu_isa
available_cpu_isas = _C.available_cpu_isas
built_with_cuda = _C.built_with_cuda


def set_cpu_isa(name):
    """Forces the CPU kernels' instruction set: one of available_cpu_isas()."""
    if name not in available_cpu_isas():
        raise ValueError(f"set_cpu_isa: isa {name!r} is not available here; choose from {available_cpu_isas()}")
    _C.set_cpu_isa(name)
