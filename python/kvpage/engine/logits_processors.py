"""The logits processors: allowed_token_ids and logit_bias, then those that read a request's own
tokens: min_tokens, and the repetition, presence and frequency penalties (vLLM's names and
semantics; the repetition penalty is HF's RepetitionPenaltyLogitsProcessor, the same float ops).

They run, in vLLM's order, on the raw logits before temperature: allowed_token_ids, logit_bias,
min_tokens, then repetition, then frequency and presence. Each works on the whole batch of rows
that use it at once, through the flat index row * vocab + token of the tokens each row has seen: one
unique() gives every count, and only those entries are read and written. Rows that use none of them
are never touched, and nothing here runs for a batch without them.
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
    return row.params.uses_penalties or row.params.uses_token_bias or bool(row.bad_words_token_ids) \
        or holds_back_stops(row)


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Apply the token bias, min_tokens and the penalties to `logits` [len(rows), vocab] in place and return it.

    `logits` must be the sampler's own copy of these rows: the caller's tensor stays the model's
    distribution, which logprobs and cumulative_logprob report.
    """
    for k, row in enumerate(rows):
        if row.params.uses_token_bias:
            apply_token_bias(logits[k], row.params.allowed_token_ids, row.params.logit_bias)
        if row.bad_words_token_ids:
            apply_bad_words(logits[k], row.bad_words_token_ids, row.output_token_ids or [])
    held = [k for k, row in enumerate(rows) if holds_back_stops(row)]
    if held:
        apply_min_tokens(logits, held, rows)
    penalised = [k for k, row in enumerate(rows) if row.params.uses_penalties]
    if len(penalised) == len(rows):
        apply_penalties(logits, rows)  # in place, no gather of the rows
    elif penalised:
        index = torch.tensor(penalised)
        logits[index] = apply_penalties(logits[index], [rows[k] for k in penalised])
    return logits


# A bias at or below this leaves a float32 logit nothing but the bias (float32's spacing there is ~1e31,
# far beyond any logit): the token is banned in all but name.
BANNING_BIAS = -1e38


def check_some_token_sampleable(params, bad_words_token_ids: tuple[tuple[int, ...], ...],
                                vocab_size: int | None) -> None:
    """ValueError, at add time, where the request's own options mask every token it may sample: each of
    allowed_token_ids (or, without them, the whole vocabulary) banned by a one-token bad word or a bias
    at or below BANNING_BIAS. The sampler would otherwise choose among masked logits, i.e. emit a token
    the request forbade."""
    masked = {word[0] for word in bad_words_token_ids if len(word) == 1}
    masked.update(t for t, b in (params.logit_bias or {}).items() if b <= BANNING_BIAS)
    if not masked:
        return
    if params.allowed_token_ids is not None:
        if all(t in masked for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids: every one of them ({_few(params.allowed_token_ids)}) is banned by"
                             f" bad_words or a logit_bias <= {BANNING_BIAS:g}; no token is left to sample")
    elif vocab_size is not None and sum(t < vocab_size for t in masked) >= vocab_size:
        raise ValueError(f"bad_words and logit_bias <= {BANNING_BIAS:g} ban the whole vocabulary ({vocab_size}"
                         f" tokens); no token is left to sample")


def _few(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:5])) + (f", ... ({len(ids)} ids)" if len(ids) > 5 else "")


def apply_token_bias(logits: torch.Tensor, allowed: list[int] | None, bias: dict[int, float] | None) -> None:
    """One row [vocab], in place: -inf outside `allowed` (where given), then `bias` added to its tokens."""
    vocab = logits.shape[0]
    for name, ids in (("allowed_token_ids", allowed), ("logit_bias", bias)):
        if ids and max(ids) >= vocab:
            raise ValueError(f"{name} names token id {max(ids)}, outside the vocabulary of {vocab}")
    if allowed is not None:
        index = torch.tensor(allowed)
        kept = logits[index]
        logits.fill_(float("-inf"))
        logits[index] = kept
    if bias:
        index = torch.tensor(list(bias))
        logits[index] += torch.tensor(list(bias.values()), dtype=logits.dtype)


def bad_words_token_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as it reads alone and after a space (the form it takes mid-text),
    the second only where that tokenizes to as many tokens with another first one (vLLM's rule)."""
    found = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(tuple(alone))
        if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            found.append(tuple(spaced))
    return tuple(ids for ids in found if ids)


def apply_bad_words(logits: torch.Tensor, bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> None:
    """One row [vocab], in place: -inf for the last token of each bad word whose other tokens end the
    output so far (a one-token word: always). As in vLLM, only output tokens count, not the prompt."""
    vocab = logits.shape[0]
    banned = [word[-1] for word in bad_words
              if word[-1] < vocab and (len(word) == 1 or tuple(output[-(len(word) - 1):]) == word[:-1])]
    if banned:
        logits[torch.tensor(banned)] = float("-inf")


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
    on logits [len(rows), vocab] (contiguous), in place; every row here uses at least one of them.

    Only the (row, token) entries a row has seen are read and written (a gather and a scatter over
    the flat index row * vocab + token): a few hundred per row, not the whole vocabulary."""
    num_rows, vocab = logits.shape
    for row in rows:
        if row.output_token_ids is None or (row.params.repetition_penalty != 1.0 and row.prompt_token_ids is None):
            raise ValueError("a SampleRow whose params use penalties needs its output_token_ids (and its"
                             " prompt_token_ids for repetition_penalty)")
    flat_logits = logits.view(-1)
    outputs = flat_token_index([row.output_token_ids for row in rows], vocab)
    repetition = [row.params.repetition_penalty for row in rows]
    if any(p != 1.0 for p in repetition):
        # Rows with no repetition penalty contribute no prompt tokens: their factor is 1 anyway.
        prompts = flat_token_index([row.prompt_token_ids if p != 1.0 else [] for row, p in zip(rows, repetition)],
                                   vocab)
        seen = torch.cat([prompts, outputs]).unique()
        factor = torch.tensor(repetition, dtype=logits.dtype)[seen // vocab]
        flat_logits[seen] = apply_repetition_penalty(flat_logits[seen], factor)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=logits.dtype)
    presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=logits.dtype)
    if (frequency.any() or presence.any()) and outputs.numel():
        index, counts = outputs.unique(return_counts=True)
        row_of = index // vocab
        flat_logits[index] = flat_logits[index] - frequency[row_of] * counts.to(logits.dtype) - presence[row_of]
    return logits


def apply_repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule for seen tokens: logit * penalty where negative, logit / penalty otherwise (a penalty
    > 1 makes a seen token less likely either way). A finite logit stays finite (a large penalty would
    overflow it to -inf, or a small one to inf, and the row's softmax to nan); a masked one stays -inf."""
    limit = torch.finfo(logits.dtype).max
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty).clamp(-limit, limit)
    return torch.where(logits.isfinite(), penalised, logits)


def flat_token_index(token_ids: list[list[int]], vocab: int) -> torch.Tensor:
    """row * vocab + token for every token of every row's list (repeats kept: they are the counts)."""
    lengths = torch.tensor([len(ids) for ids in token_ids])
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}) to be penalised,"
                         f" got {int(flat.min())}..{int(flat.max())}")
    return torch.repeat_interleave(torch.arange(len(token_ids)), lengths) * vocab + flat
