"""Draft-model proposals (vLLM's "draft_model" method): a smaller model with the target's tokenizer
proposes k tokens greedily (so its proposal is deterministic: q is one-hot in the rejection sampler).

Every sequence of a step proposes in one batch: k forward passes of the draft (transformers' own forward)
for all of them, not k per sequence. Each sequence keeps its draft K/V between steps, cut back to the tokens
it actually kept (rejected drafts leave the draft's cache this way, as they leave the target's paged cache by
its computed-token count). A step lays the kept K/V out as one batch, left-padded to the longest, with the new
tokens after them, right-padded (so every query sees a real key: no fully masked row), an attention mask
marking the padding and explicit positions; afterwards each sequence takes its real columns back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

PAD_TOKEN = 0  # fed in padding columns; masked out, so any id does


@dataclass
class _DraftState:
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer K, V [heads, len, dim]
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V those hold


@dataclass
class _Row:
    """One sequence's place in a step's batch: its kept K/V (cache columns) and the tokens it feeds."""
    state: _DraftState
    keep: int  # tokens of the state kept
    feed: list[int]  # tokens after those, fed in the first pass
    k: int  # drafts to propose


def load_draft_model(model, target_vocab_size: int):
    """A directory (loaded with transformers' attention, not kvpage's) or a PreTrainedModel; its vocabulary
    must fit in the target's."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        draft = model
    elif isinstance(model, str):
        try:
            draft = AutoModelForCausalLM.from_pretrained(model, dtype="auto", attn_implementation="sdpa")
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config['model']: no model could be loaded from {model!r}: {e}") from e
    else:
        raise ValueError(f"speculative_config['model'] must be a local HF model directory, got {type(model).__name__}")
    if draft.config.vocab_size > target_vocab_size:
        raise ValueError(f"speculative_config['model']: the draft's vocab_size {draft.config.vocab_size} exceeds the"
                         f" target's {target_vocab_size}; the draft must share the target's tokenizer")
    return draft.eval()


class DraftModelProposer:
    def __init__(self, model) -> None:
        self.model = model
        self._states: dict[int, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, batch: list[tuple[object, int]]) -> list[list[int]]:
        """(sequence, k) pairs -> each sequence's k greedy draft tokens, from k batched passes of the draft."""
        if not batch:
            return []
        rows = [self._row(seq, k) for seq, k in batch]
        device = next(self.model.parameters()).device
        num_cached = max(row.keep for row in rows)
        cache, mask = _batched_cache(rows, num_cached, device)
        width = max(len(row.feed) for row in rows)
        ids = torch.tensor([row.feed + [PAD_TOKEN] * (width - len(row.feed)) for row in rows], device=device)
        positions = torch.tensor([row.keep for row in rows], device=device).unsqueeze(1) + torch.arange(width, device=device)
        mask = torch.cat([mask, _right_padded_mask([len(row.feed) for row in rows], width, device)], dim=1)
        # The logits of each row's last real token only: its column, among the distinct ones the batch needs.
        last = [len(row.feed) - 1 for row in rows]
        columns = sorted(set(last))
        logits = self._forward(ids, positions, mask, cache, torch.tensor(columns, device=device))
        tokens = logits[torch.arange(len(rows)), torch.tensor([columns.index(c) for c in last])].argmax(dim=-1)
        drafts = [tokens]
        position = torch.tensor([[row.keep + len(row.feed)] for row in rows], device=device)  # the first draft's
        for _ in range(max(row.k for row in rows) - 1):
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            drafts.append(self._forward(drafts[-1].unsqueeze(1), position, mask, cache, 1)[:, -1].argmax(dim=-1))
            position = position + 1
        drafts = torch.stack(drafts, dim=1).tolist()
        out = []
        for i, (row, (seq, k)) in enumerate(zip(rows, batch)):
            row.state.kv = _take_row(cache, mask, i, row.keep + len(row.feed) + k - 1)
            row.state.tokens = list(seq.token_ids) + drafts[i][:k - 1]
            out.append(drafts[i][:k])
        return out

    def _row(self, seq, k: int) -> _Row:
        """The sequence's state, cut back to the tokens it still has (at least its last token is fed)."""
        tokens = seq.token_ids
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _DraftState()
        keep = min(_common_prefix(state.tokens, tokens), len(tokens) - 1)
        state.kv = [(key[:, :keep], value[:, :keep]) for key, value in state.kv] if keep else []
        return _Row(state, keep, list(tokens[keep:]), k)

    def _forward(self, ids, positions, mask, cache, logits_to_keep) -> torch.Tensor:
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                          logits_to_keep=logits_to_keep).logits

    def forget(self, live_seq_ids: set[int]) -> None:
        for seq_id in [i for i in self._states if i not in live_seq_ids]:
            del self._states[seq_id]


def _batched_cache(rows: list[_Row], num_cached: int, device) -> tuple[object, torch.Tensor]:
    """A DynamicCache of the rows' kept K/V, left-padded to num_cached columns, and its attention mask."""
    from transformers import DynamicCache

    mask = torch.zeros(len(rows), num_cached, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        mask[i, num_cached - row.keep:] = 1
    if num_cached == 0:
        return DynamicCache(), mask
    template = next(row.state.kv for row in rows if row.keep)
    layers = []
    for layer, (key, value) in enumerate(template):
        keys = key.new_zeros(len(rows), key.shape[0], num_cached, key.shape[2])
        values = value.new_zeros(len(rows), value.shape[0], num_cached, value.shape[2])
        for i, row in enumerate(rows):
            if row.keep:
                keys[i, :, num_cached - row.keep:] = row.state.kv[layer][0]
                values[i, :, num_cached - row.keep:] = row.state.kv[layer][1]
        layers.append((keys, values))
    return DynamicCache(layers), mask


def _right_padded_mask(lengths: list[int], width: int, device) -> torch.Tensor:
    return (torch.arange(width, device=device) < torch.tensor(lengths, device=device).unsqueeze(1)).long()


def _take_row(cache, mask: torch.Tensor, i: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row i's first `length` real columns of every layer: the K/V its state keeps."""
    real = mask[i].nonzero().squeeze(1)[:length]
    return [(layer.keys[i][:, real], layer.values[i][:, real]) for layer in cache.layers]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
