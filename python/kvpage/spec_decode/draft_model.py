"""Draft-model proposals (vLLM's "draft_model" method): a smaller model with the target's tokenizer
proposes k tokens greedily (so its proposal is deterministic: q is one-hot in the rejection sampler).

The draft runs on transformers' own forward with a DynamicCache per sequence, cropped back to the tokens
the sequence actually kept (rejected drafts leave the cache this way, as they leave the target's paged
cache by its computed-token count).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _DraftState:
    cache: object
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the cache holds


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
    def propose(self, seq, k: int) -> list[int]:
        from transformers import DynamicCache

        tokens = seq.token_ids
        state = self._states.get(seq.seq_id)
        keep = _common_prefix(state.tokens, tokens) if state is not None else 0
        keep = min(keep, len(tokens) - 1)  # at least the last token runs, for its logits
        if state is None or keep == 0:
            state = self._states[seq.seq_id] = _DraftState(DynamicCache())
        elif keep < state.cache.get_seq_length():
            state.cache.crop(keep - state.cache.get_seq_length())  # a negative count: tokens to remove
        device = next(self.model.parameters()).device
        feed = tokens[keep:]
        drafts = []
        for _ in range(k):
            ids = torch.tensor([feed], device=device)
            logits = self.model(input_ids=ids, cache=state.cache, use_cache=True, logits_to_keep=1).logits
            drafts.append(int(logits[0, -1].argmax()))
            feed = [drafts[-1]]
        state.tokens = list(tokens) + drafts[:-1]
        return drafts

    def forget(self, live_seq_ids: set[int]) -> None:
        for seq_id in [i for i in self._states if i not in live_seq_ids]:
            del self._states[seq_id]


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
