"""Beam selection: after each step in which a beam request's beams all sampled, the next beams.

The beams are the request's sequences in the scheduler, batched with every other request; the
engine turns their logits into a BeamStep ((parent, token) per next beam), and the scheduler forks
the children onto their parents' blocks (copy-on-write when they write) and frees the old beams.
The selection rules are transformers' `_beam_search` (early_stopping=False): keep the 2k best
continuations; those that end (eos, stop id, length) among the first k enter the finished list
scored sum_logprob / generated_len ** length_penalty; the best k that do not end keep running;
stop once no running beam can beat the worst finished one (HF's heuristic), so the output matches
HF token for token. `select_beams` changes nothing: the engine keeps its result once the step commits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import groupby

import torch

from kvpage.core import BeamStep, Sequence
from kvpage.core.scheduler_config import check_max_model_len

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

_NEG = -1.0e9  # HF's "impossible" score
# Powers of the length up to e**700 (and down to e**-700) are plain floats; past that, log space.
_MAX_LOG = 700.0


def length_normalised(logprob: float, length: int, length_penalty: float) -> float:
    """logprob / length ** length_penalty (HF's beam score) for every finite length_penalty.

    Where the power fits a float this is HF's own arithmetic, so beams rank exactly as HF ranks them;
    where it would overflow (OverflowError) or underflow to 0 (ZeroDivisionError), the quotient is
    taken in log space and saturates at +-e**700 instead.
    """
    log_power = length_penalty * math.log(length)
    if abs(log_power) < _MAX_LOG:
        return logprob / length ** length_penalty
    if logprob == 0.0:
        return logprob
    return math.copysign(math.exp(min(math.log(abs(logprob)) - log_power, _MAX_LOG)), logprob)


@dataclass
class _Hypothesis:
    tokens: list[int]  # output tokens
    score: float  # length-penalised, as HF ranks them
    logprob: float  # the raw sum


@dataclass(frozen=True)
class BeamSearchState:
    """One beam request's search, between steps: the running beams' scores (in the order of the
    request's sequences), the finished list (best first) and HF's stopping flag."""

    beam_width: int
    length_penalty: float
    prompt_len: int
    max_len: int  # prompt + max_tokens, or max_model_len
    stops: frozenset[int]
    scores: tuple[float, ...] = (0.0,)
    finished: tuple[_Hypothesis, ...] = ()
    unsatisfied: bool = True

    @property
    def keep(self) -> int:
        return max(2, 1 + len(self.stops)) * self.beam_width


def new_beam_search(params: SamplingParams, prompt_len: int, max_model_len: int | None,
                    eos_token_ids: tuple[int, ...]) -> BeamSearchState:
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return BeamSearchState(params.beam_width, params.length_penalty, prompt_len,
                           check_max_model_len(prompt_len, params.max_tokens, max_model_len), frozenset(stops))


def select_beams(searches: list[tuple[BeamSearchState, list[Sequence], list[int]]],
                 logits: torch.Tensor) -> list[tuple[BeamSearchState, BeamStep]]:
    """One HF iteration for each beam request whose beams sampled this step: (state, running beams,
    their rows in `logits`) in, (new state, step for the scheduler) out, in the same order. The
    scheduler ends a request once HF would stop.

    All the requests' beams go through one log-softmax, and requests with as many beams through one
    top-k: row by row the same arithmetic as HF's (one request at a time), at a step's cost of a few
    ops instead of a few per request, which under load each pay for waking every thread."""
    def shape(i: int) -> tuple[int, int]:  # requests of one shape share a top-k
        return len(searches[i][1]), searches[i][0].keep

    order = sorted(range(len(searches)), key=shape)
    index = torch.tensor([r for i in order for r in searches[i][2]], dtype=torch.long, device=logits.device)
    scores = torch.tensor([s for i in order for s in searches[i][0].scores], device=logits.device)
    # HF's beam scores: each beam's running sum plus its log-softmax.
    acc = logits[index].float().log_softmax(dim=-1).add_(scores.unsqueeze(1))
    vocab = acc.shape[1]
    results: list = [None] * len(searches)
    start = 0
    for (num_beams, keep), group in groupby(order, key=shape):
        group = list(group)
        rows = acc[start:start + len(group) * num_beams].view(len(group), num_beams * vocab)
        start += len(group) * num_beams
        # Before the first decode every beam is the prompt: only beam 0 counts (HF scores the others -1e9).
        top_scores, top_idx = torch.topk(rows, k=min(keep, rows.shape[1]), dim=1)
        for i, row_scores, row_idx in zip(group, top_scores.tolist(), top_idx.tolist()):
            cands = [(s, j // vocab, j % vocab) for s, j in zip(row_scores, row_idx)]
            results[i] = _next_beams(searches[i][0], cands, searches[i][1])
    return results


def _next_beams(state: BeamSearchState, cands: list[tuple[float, int, int]],
                beams: list[Sequence]) -> tuple[BeamSearchState, BeamStep]:
    """From the top candidates (score, beam, token), best first: the finished list and the next beams."""
    cur_len = beams[0].num_tokens
    hits = [tok in state.stops or cur_len + 1 >= state.max_len for _, _, tok in cands]
    finished = _update_finished(state, beams, cands, hits, cur_len)
    masked = torch.tensor([s + (_NEG if h else 0.0) for (s, _, _), h in zip(cands, hits)])
    order = torch.topk(masked, k=state.beam_width).indices.tolist()
    children = tuple((beams[cands[j][1]].seq_id, cands[j][2]) for j in order)
    scores = tuple(masked[j].item() for j in order)
    unsatisfied = state.unsatisfied and not _satisfied(state, finished, scores[0], cur_len + 1)
    new = replace(state, scores=scores, finished=finished, unsatisfied=unsatisfied)
    if unsatisfied and not all(hits):
        return new, BeamStep(children)
    return new, BeamStep(finish_reason=_finish_reason(new))


def _update_finished(state: BeamSearchState, beams: list[Sequence], cands, hits, cur_len: int) -> tuple:
    """The k best of the finished list and the candidates that end among the first k. HF masks the
    others (and its list's empty slots) with -1e9 and takes a top-k; leaving them out picks the
    same beams, and a real hypothesis scoring below -1e9 (a large negative length_penalty) stays."""
    if not state.unsatisfied:
        return state.finished
    length = cur_len + 1 - state.prompt_len
    merged = list(state.finished)
    for (score, beam, tok), hit in zip(cands[:state.beam_width], hits):
        if hit:
            tokens = beams[beam].token_ids[state.prompt_len:] + [tok]
            merged.append(_Hypothesis(tokens, length_normalised(score, length, state.length_penalty), score))
    # HF's top-k over float32 scores: the same ties, the same order.
    order = torch.topk(torch.tensor([h.score for h in merged]), k=min(state.beam_width, len(merged))).indices.tolist()
    return tuple(merged[i] for i in order)


def _satisfied(state: BeamSearchState, finished: tuple, best_running: float, cur_len: int) -> bool:
    """HF's heuristic: the finished list is full and the best running beam cannot beat its worst."""
    if len(finished) < state.beam_width:  # an open slot: any running beam can still get in
        return False
    best = length_normalised(best_running, cur_len - state.prompt_len, state.length_penalty)
    return best <= min(h.score for h in finished)


def _finish_reason(state: BeamSearchState) -> str:
    return "stop" if any(h.tokens and h.tokens[-1] in state.stops for h in state.finished) else "length"


def beam_output(state: BeamSearchState, request_id: str, prompt: str | None, prompt_ids: list[int],
                params: SamplingParams, tokenizer, metrics: dict) -> RequestOutput:
    """The finished request's beam_width best beams, best first; cumulative_logprob is the raw sum."""
    skip = params.skip_special_tokens
    outputs = [CompletionOutput(i, tokenizer.decode(h.tokens, skip_special_tokens=skip) if tokenizer else "",
                                h.tokens, "stop" if h.tokens and h.tokens[-1] in state.stops else "length", h.logprob)
               for i, h in enumerate(state.finished)]
    return RequestOutput(request_id, prompt, list(prompt_ids), outputs, finished=True, metrics=metrics)
