"""Victim policies: which running request gives up its blocks when another cannot get one.

A policy only ranks candidates; the scheduler decides who is a candidate (running, not yet
scheduled this step) and how the victim is preempted. `preemption_mode` lets a policy carry its own
mode ("swap" / "recompute"); None leaves the choice to the cost model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .request import Request

PREEMPTION_MODES = ("swap", "recompute")


class VictimPolicy(Protocol):
    name: str
    preemption_mode: str | None

    def select(self, candidates: list[Request]) -> Request:
        ...


@dataclass(frozen=True)
class MostRecentlyAdmitted:
    """vLLM's default: the request admitted last goes first. No bookkeeping about progress, and the
    oldest request is never a victim, which bounds everyone's wait."""

    preemption_mode: str | None = None
    name: str = "recent"

    def select(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: r.admit_order)


@dataclass(frozen=True)
class LeastProgressLost:
    """The request whose preemption throws away least: fewest computed tokens, then most tokens
    left to generate. A request within `protect_tokens` of its max_tokens is taken only when
    nothing else is left, since finishing it frees all of its blocks a step later anyway."""

    preemption_mode: str | None = None
    protect_tokens: int = 1
    name: str = "least_progress"

    def select(self, candidates: list[Request]) -> Request:
        def cost(r: Request):
            nearly_done = r.num_tokens_left <= self.protect_tokens * max(1, len(r.live_seqs()))
            # Ties go to the most recent admission, as in the default policy.
            return (nearly_done, r.num_computed_tokens, -r.num_tokens_left, -r.admit_order)
        return min(candidates, key=cost)


POLICIES = {"recent": MostRecentlyAdmitted, "least_progress": LeastProgressLost}


def get_policy(policy: str | VictimPolicy, preemption_mode: str | None = None) -> VictimPolicy:
    """A policy by name ("recent", "least_progress") or as given; preemption_mode overrides its mode."""
    check_preemption_mode(preemption_mode)
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)} or a VictimPolicy, got {policy!r}")
        return POLICIES[policy](preemption_mode=preemption_mode)
    if not callable(getattr(policy, "select", None)):
        raise TypeError(f"policy must have a select(candidates) method, got {type(policy).__name__}")
    check_preemption_mode(getattr(policy, "preemption_mode", None))
    return policy


def check_preemption_mode(mode: str | None) -> None:
    if mode is not None and mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be 'swap', 'recompute' or None, got {mode!r}")
