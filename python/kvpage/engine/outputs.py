"""What generate() and LLMEngine.step() return (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample (or beam) of a request. finish_reason: None while running, else "stop" (eos, a stop
    token id or a stop string), "length" (max_tokens or the model's length) or "abort"."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Engine-step timing for latency figures: seconds from add_request to the first output token.
    metrics: dict = field(default_factory=dict, repr=False)
