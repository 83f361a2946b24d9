"""The logits processors that read a request's own tokens: min_tokens, and the repetition, presence
and frequency penalties (vLLM's names and semantics; the repetition penalty is HF's
RepetitionPenaltyLogitsProcessor, the same float ops).

They run, in vLLM's order, on the raw logits before temperature: min_tokens, then repetition, then
frequency and presence. Each works on the whole batch of rows that use it at once: one bincount over
all rows' output tokens (flat index row * vocab + token) gives every count, one scatter the prompt
masks. Rows that use none of them are never touched, and nothing here runs for a batch without them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampler import SampleRow


def holds_back_stops(row: SampleRow) -> bool:
    """min_tokens is still keeping this row's stop tokens out."""
    return row.position < row.params.min_tokens and bool(row.stop_token_ids)


def needs_processing(row: SampleRow) -> bool:
    return row.params.uses_penalties or holds_back_stops(row)


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Apply min_tokens and the penalties to `logits` [len(rows), vocab] in place and return it.

    `logits` must be the sampler's own copy of these rows: the caller's tensor stays the model's
    distribution, which logprobs and cumulative_logprob report.
    """
    held = [k for k, row in enumerate(rows) if holds_back_stops(row)]
    if held:
        apply_min_tokens(logits, held, rows)
    penalised = [k for k, row in enumerate(rows) if row.params.uses_penalties]
    if penalised:
        index = torch.tensor(penalised)
        logits[index] = apply_penalties(logits[index], [rows[k] for k in penalised])
    return logits


def apply_min_tokens(logits: torch.Tensor, held: list[int], rows: list[SampleRow]) -> None:
    """-inf for every token that would end rows `held` (eos, stop_token_ids) before min_tokens, so
    neither greedy nor sampling can pick them. A stop id beyond the vocabulary can never be sampled
    anyway, so it is left out rather than indexed."""
    vocab = logits.shape[1]
    pairs = [(k, t) for k in held for t in rows[k].stop_token_ids if t < vocab]
    if pairs:
        row_index, token_index = torch.tensor(pairs).unbind(1)
        logits[row_index, token_index] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (over prompt and output tokens), then frequency and presence (output tokens only),
    on logits [len(rows), vocab]; every row here uses at least one of them."""
    num_rows, vocab = logits.shape
    for row in rows:
        if row.output_token_ids is None or (row.params.repetition_penalty != 1.0 and row.prompt_token_ids is None):
            raise ValueError("a SampleRow whose params use penalties needs its output_token_ids (and its"
                             " prompt_token_ids for repetition_penalty)")
    counts = bincount_rows([row.output_token_ids for row in rows], num_rows, vocab)
    repetition = [row.params.repetition_penalty for row in rows]
    if any(p != 1.0 for p in repetition):
        # Rows with no repetition penalty contribute no prompt tokens: their factor is 1 anyway.
        prompts = [row.prompt_token_ids if p != 1.0 else [] for row, p in zip(rows, repetition)]
        seen = (bincount_rows(prompts, num_rows, vocab) > 0) | (counts > 0)
        logits = apply_repetition_penalty(logits, seen, torch.tensor(repetition))
    frequency = torch.tensor([row.params.frequency_penalty for row in rows]).unsqueeze(1)
    presence = torch.tensor([row.params.presence_penalty for row in rows]).unsqueeze(1)
    if frequency.any() or presence.any():
        counts = counts.to(logits.dtype)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule, seen tokens only: logit * penalty where negative, logit / penalty otherwise (a
    penalty > 1 makes a seen token less likely either way)."""
    p = penalty.to(logits.dtype).unsqueeze(1)
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def bincount_rows(token_ids: list[list[int]], num_rows: int, vocab: int) -> torch.Tensor:
    """counts [num_rows, vocab]: how often each token occurs in each row's list (one bincount)."""
    lengths = torch.tensor([len(ids) for ids in token_ids])
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    if flat.numel() == 0:
        return torch.zeros(num_rows, vocab, dtype=torch.int64)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}) to be penalised,"
                         f" got {int(flat.min())}..{int(flat.max())}")
    row_of = torch.repeat_interleave(torch.arange(num_rows), lengths)
    return torch.bincount(row_of * vocab + flat, minlength=num_rows * vocab).view(num_rows, vocab)
