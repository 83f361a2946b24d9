"""Copy-on-write: blocks held by n samples (or k beams) of one prompt, with sharing vs without.

With sharing, the prompt's full blocks are held once. The block a sequence writes next is copied
only if someone else still points at it, and the last writer keeps the original: so n samples
diverging inside a partial prompt block cost n - 1 copies, and each then grows privately.
`cached_tokens` counts tokens whose K/V sit in the cache: with max_tokens=G the last sampled token is
never written, so a finished sample of G tokens has G - 1 of its own in the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

from .memory import blocks_per_sequence


@dataclass(frozen=True)
class SharingPlan:
    num_seqs: int
    prompt_tokens: int
    generated_tokens: int  # per sequence, in the cache
    blocks_shared: int  # total blocks held with sharing (upper bound for beam search)
    blocks_unshared: int  # each sequence with its own full copy
    blocks_shared_min: int  # lower bound: equals blocks_shared except for beam search

    @property
    def saved_blocks(self) -> int:
        return self.blocks_unshared - self.blocks_shared

    @property
    def saved_fraction(self) -> float:
        return self.saved_blocks / self.blocks_unshared


def parallel_sampling(num_seqs: int, prompt_tokens: int, generated_tokens: int, block_size: int = 16) -> SharingPlan:
    """n samples of one prompt, each generated_tokens past it (in the cache)."""
    _check(num_seqs, prompt_tokens, generated_tokens)
    total = blocks_per_sequence(prompt_tokens + generated_tokens, block_size)
    if generated_tokens == 0:  # nobody has written yet: even the partial block is still shared
        shared = total
    else:
        full = prompt_tokens // block_size
        shared = full + num_seqs * (total - full)
    return SharingPlan(num_seqs, prompt_tokens, generated_tokens, shared, num_seqs * total, shared)


def beam_search(beam_width: int, prompt_tokens: int, generated_tokens: int, block_size: int = 16) -> SharingPlan:
    """k beams: bounds, since which beams share generated blocks depends on the scores.

    Upper bound: the beams share only the prompt (as k independent samples would). Lower bound: they
    share every block but the last, which differs because the beams differ in at least their last token.
    """
    upper = parallel_sampling(beam_width, prompt_tokens, generated_tokens, block_size)
    total = blocks_per_sequence(prompt_tokens + generated_tokens, block_size)
    lower = total - 1 + beam_width if generated_tokens else total
    return SharingPlan(beam_width, prompt_tokens, generated_tokens, upper.blocks_shared, upper.blocks_unshared,
                       min(lower, upper.blocks_shared))


def _check(num_seqs: int, prompt_tokens: int, generated_tokens: int) -> None:
    if num_seqs < 1 or prompt_tokens < 1 or generated_tokens < 0:
        raise ValueError(f"need num_seqs >= 1, prompt_tokens >= 1, generated_tokens >= 0; got {num_seqs},"
                         f" {prompt_tokens}, {generated_tokens}")
