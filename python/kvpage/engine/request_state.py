"""The engine's per-request records: what it keeps beside the scheduler's Request to answer it (sampling
parameters, log-probabilities, incremental text)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvpage.core import Request

from .beam_search import BeamSearchState
from .detokenizer import IncrementalDetokenizer
from .outputs import Logprob
from .sampling_params import SamplingParams


@dataclass
class SampleState:
    cumulative_logprob: float = 0.0
    detok: IncrementalDetokenizer | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per output token, where params.logprobs is set
    # [spec decode] the last speculative step's tokens: (token count after it, cumulative_logprob before it,
    # its tokens' logprobs), for a stop string inside the run to take back the tokens it cuts.
    spec_run: tuple[int, float, list[float]] | None = None


@dataclass
class RequestState:
    request: Request | None  # the scheduler's (its sequences hold the token ids); set as it is queued
    prompt: str | None
    params: SamplingParams
    stream: bool
    samples: list[SampleState]
    index_of: dict[int, int]  # seq_id -> sample index (the order of the request's sequences)
    stop_ids: tuple[int, ...] = ()  # what min_tokens holds back: eos (unless ignore_eos) and stop_token_ids
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, position 1's, ...] so far
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    beam: BeamSearchState | None = None  # beam search: the search so far (the scheduler holds the beams)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    @property
    def needs_detok(self) -> bool:
        return self.stream or bool(self.params.stop)
