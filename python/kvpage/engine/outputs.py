"""What generate() and LLMEngine.step() return (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry in CompletionOutput.logprobs (vLLM's Logprob). logprob: the model's
    log-softmax before penalties, temperature and filters; rank: 1 + the number of tokens the model
    makes strictly more likely (1 = most likely); decoded_token: the token alone, decoded (None
    without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample (or beam) of a request. finish_reason: None while running, else "stop" (eos, a stop
    token id or a stop string), "length" (max_tokens or the model's length) or "abort".
    logprobs: with SamplingParams(logprobs=k), one {token_id: Logprob} per output token, the sampled
    token first and the k most likely (k + 1 entries, or k where the sampled one is among them);
    cumulative_logprob is the sum of the sampled tokens' entries. None without logprobs."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """prompt_logprobs: with SamplingParams(prompt_logprobs=k), None for the first prompt token (nothing
    precedes it), then per prompt token a {token_id: Logprob} of that token first and the k most
    likely at its position, from the model's log-softmax; None without prompt_logprobs.
    num_cached_tokens: as vLLM's, the prompt tokens the prefix cache held at the request's admission."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Engine-step timing for latency figures: seconds from add_request to the first output token.
    metrics: dict = field(default_factory=dict, repr=False)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens read from the prefix cache (None: not admitted yet)
