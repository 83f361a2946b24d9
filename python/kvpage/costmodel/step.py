"""Time of one engine step on a roofline: the FLOPs of its tokens or the bytes it reads, whichever
is slower, plus a fixed per-step cost. Prefix caching and chunked prefill are priced in these steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from .device import Device
from .memory import kv_bytes_per_token
from .model import ModelShape


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: new tokens on top of a cached context."""

    num_new_tokens: int
    num_cached_tokens: int = 0


def step_seconds(model: ModelShape, device: Device, chunks: list[Chunk], dtype_bytes: int | None = None,
                 attention_term: bool = True) -> float:
    """One forward pass over every chunk: max(FLOPs / achievable rate, bytes / memory bandwidth) plus
    the device's fixed step overhead. Bytes: the weights once, plus every chunk's K/V context."""
    dtype_bytes = dtype_bytes or device.dtype_bytes
    tokens = sum(c.num_new_tokens for c in chunks)
    flops = model.flops_per_token * tokens
    if attention_term:
        flops += sum(model.attention_flops(c.num_new_tokens, c.num_cached_tokens) for c in chunks)
    context = sum(c.num_cached_tokens + c.num_new_tokens for c in chunks)
    nbytes = model.weight_bytes(dtype_bytes) + context * kv_bytes_per_token(model, dtype_bytes)
    return device.step_overhead_s + max(flops / device.achievable_flops, nbytes / device.memory_bandwidth)


def chunked_prefill_steps(model: ModelShape, device: Device, prompt_tokens: int, decode_contexts: list[int],
                          max_num_batched_tokens: int, dtype_bytes: int | None = None) -> list[float]:
    """Seconds of each step while a prompt is prefilled next to running decodes.

    Each step runs one token per decode (their contexts grow by one a step) and as much of the prompt
    as the token budget has left: with a budget at least prompt + decodes the whole prompt goes in
    one step, which is then the decodes' inter-token latency.
    """
    if max_num_batched_tokens <= len(decode_contexts):
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} leaves no room for the prompt next"
                         f" to {len(decode_contexts)} decodes")
    done, steps, contexts = 0, [], list(decode_contexts)
    while done < prompt_tokens:
        n = min(prompt_tokens - done, max_num_batched_tokens - len(contexts))
        chunks = [Chunk(1, c) for c in contexts] + [Chunk(n, done)]
        steps.append(step_seconds(model, device, chunks, dtype_bytes))
        done += n
        contexts = [c + 1 for c in contexts]
    return steps
