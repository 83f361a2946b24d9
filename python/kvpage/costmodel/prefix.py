"""Prefix caching priced as time to first token: N concurrent requests sharing a system prompt.

All requests arrive together with max_tokens=1, so prefill is all there is. The scheduler is
modelled as kvpage's (and vLLM v1's): first come, first served, each step packing up to
max_num_batched_tokens prompt tokens, a long prompt chunked across steps. A request's prefix-cache
hit is decided when it is admitted: the hash chain matches whole blocks whose K/V exist or are being
computed in the same step by a request admitted before it (each layer writes every token's K/V
before any token attends). So once the first request's chunk reaches the end of the shared prompt,
every request admitted after it hits the whole shared prompt, in that step or later.
Request i's time to first token is the end of the step that computes its last prompt token.
"""
from __future__ import annotations

from dataclasses import dataclass

from .device import Device
from .model import ModelShape
from .step import Chunk, step_seconds


@dataclass(frozen=True)
class PrefixCachePlan:
    num_requests: int
    shared_tokens: int
    unique_tokens: int
    max_num_batched_tokens: int
    ttft_off_s: list[float]  # per request, in arrival order
    ttft_on_s: list[float]
    hit_tokens_on: list[int]  # per request, with the cache on

    @property
    def mean_off_s(self) -> float:
        return sum(self.ttft_off_s) / len(self.ttft_off_s)

    @property
    def mean_on_s(self) -> float:
        return sum(self.ttft_on_s) / len(self.ttft_on_s)

    @property
    def speedup(self) -> float:
        return self.mean_off_s / self.mean_on_s

    @property
    def saved_prefill_tokens(self) -> int:
        return sum(self.hit_tokens_on)


def prefix_cache_ttft(model: ModelShape, device: Device, num_requests: int = 50, shared_tokens: int = 2000,
                      unique_tokens: int = 32, block_size: int = 16, max_num_batched_tokens: int = 2048,
                      dtype_bytes: int | None = None) -> PrefixCachePlan:
    if num_requests < 1 or shared_tokens < 0 or unique_tokens < 1 or max_num_batched_tokens < 1:
        raise ValueError(f"need num_requests >= 1, shared_tokens >= 0, unique_tokens >= 1 and"
                         f" max_num_batched_tokens >= 1; got {num_requests}, {shared_tokens}, {unique_tokens},"
                         f" {max_num_batched_tokens}")
    prompt = shared_tokens + unique_tokens
    # Full blocks of the shared prompt (each request's own tail, >= 1 token, is never a hit).
    hit = shared_tokens // block_size * block_size
    args = (model, device, num_requests, prompt, max_num_batched_tokens, dtype_bytes)
    off, _ = _serve(*args, hit_tokens=0)
    on, hits = _serve(*args, hit_tokens=hit)
    return PrefixCachePlan(num_requests, shared_tokens, unique_tokens, max_num_batched_tokens, off, on, hits)


def _serve(model, device, num_requests, prompt, budget, dtype_bytes, hit_tokens):
    """(ttft per request, hit tokens per request): FCFS steps of at most `budget` tokens."""
    computed = [None] * num_requests  # None: not admitted yet
    hits = [0] * num_requests
    ttft = [0.0] * num_requests
    clock, head, cached = 0.0, 0, False  # cached: the shared blocks exist, or are being computed
    while head < num_requests:
        left, chunks, done = budget, [], []
        for i in range(head, num_requests):
            if computed[i] is None:
                hits[i] = hit_tokens if cached else 0
                computed[i] = hits[i]
            n = min(prompt - computed[i], left)
            chunks.append(Chunk(n, computed[i]))
            computed[i] += n
            left -= n
            cached = cached or (hit_tokens > 0 and computed[i] >= hit_tokens)
            if computed[i] == prompt:
                done.append(i)
            if left == 0:
                break
        clock += step_seconds(model, device, chunks, dtype_bytes)
        for i in done:
            ttft[i] = clock
        head += len(done)
    return ttft, hits


def resident_blocks(num_requests: int, shared_tokens: int, unique_tokens: int, block_size: int = 16) -> tuple[int, int]:
    """(with the prefix cache, without) blocks held while all the requests are resident at once:
    the shared prompt's full blocks are referenced, not copied, by every hit."""
    total = -(-(shared_tokens + unique_tokens) // block_size)
    full = shared_tokens // block_size
    return full + num_requests * (total - full), num_requests * total
