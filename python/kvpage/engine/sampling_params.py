"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Containers a list of stops may come in (order never matters: the earliest match wins).
_COLLECTIONS = (list, tuple, set, frozenset)


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, _COLLECTIONS) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be None, a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def _stop_token_ids(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, _COLLECTIONS) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids must be None or a list of non-negative ints, got {ids!r}")
    return list(ids)


@dataclass
class SamplingParams:
    """temperature=0 is greedy; top_k=0 (or -1) and top_p=1 disable those filters.

    seed: a per-request generator, so the same seed gives the same tokens whatever else shares the
    batch. beam_width > 1 runs beam search (deterministic, as HF generate(num_beams=beam_width,
    do_sample=False)); temperature, top-k/p, seed and n are ignored, and the beam_width best beams
    are returned, best first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it) and normalise stop / stop_token_ids to lists.

        A dataclass does not re-check fields assigned after construction, so add_request calls this
        again: a mutated SamplingParams is rejected before anything runs.
        """
        self._check_ints()
        self._check_floats()
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _check_ints(self) -> None:
        for name, low in (("n", 1), ("max_tokens", 1), ("beam_width", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int: 0 or -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    def _check_floats(self) -> None:
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        # Any finite value works (beam_search normalises in log space where a power would overflow).
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.beam_width > 1

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def needs_filter(self) -> bool:
        """top-k or top-p cuts the distribution (a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
