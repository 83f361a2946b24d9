"""The scheduler's settings and its counters, and the length check admission and beam search share."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.engine.arg_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS  # pure Python

from .block_manager import BlockManagerStats
from .preemption_cost import MeasuredCostModel, PreemptionCostModel
from .policies import VictimPolicy, check_preemption_mode


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # declared once, with the engine's options
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None  # prompt + max_tokens beyond this is rejected at admission
    policy: str | VictimPolicy = "recent"  # "recent" | "least_progress" | a VictimPolicy
    preemption_mode: str | None = None  # "swap" | "recompute" | None: the policy's, else the cost model's
    cost_model: PreemptionCostModel | MeasuredCostModel = field(default_factory=PreemptionCostModel)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive int or None, got {self.max_model_len!r}")
        check_preemption_mode(self.preemption_mode)


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    num_finished: int
    num_preemptions: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    blocks: BlockManagerStats


def check_max_model_len(num_prompt: int, max_tokens: int, max_model_len: int | None, prefix: str = "") -> int:
    """The most tokens the sequence can reach: prompt + max_tokens, capped at max_model_len, where a
    sequence stops with finish reason "length" as in vLLM's LLM (the check add_request and beam
    search's up-front check share). ValueError (message led by prefix) for a prompt longer than
    max_model_len, which could not even be computed."""
    if max_model_len is not None and num_prompt > max_model_len:
        raise ValueError(f"{prefix}prompt of {num_prompt} tokens exceeds max_model_len={max_model_len}")
    total = num_prompt + max_tokens
    return total if max_model_len is None else min(total, max_model_len)
