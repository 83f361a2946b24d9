"""The draft model proposes for every sequence of a step in one batch: each proposal is the draft's own greedy
continuation of that sequence alone (the draft run without a cache), across steps where sequences keep part of
their drafts, reject them, join and leave, and propose different numbers of tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpage.spec_decode.draft_model import DraftModelProposer, load_draft_model


@dataclass
class _Seq:
    seq_id: int
    token_ids: list[int]


def _greedy(model, tokens: list[int], k: int) -> list[int]:
    """k greedy tokens after `tokens`, each from a full forward pass over everything before it."""
    tokens = list(tokens)
    with torch.inference_mode():
        for _ in range(k):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[-k:]


def _check(proposer, model, batch) -> list[list[int]]:
    got = proposer.propose(batch)
    assert got == [_greedy(model, seq.token_ids, k) for seq, k in batch]
    return got


def _draft(vocab_size: int):
    """A random Llama whose attention is far from uniform (a large init scale), so that a token's position
    and every cached key it reads change its greedy continuation."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
                         max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def test_batched_proposals_are_each_sequences_own(tokenizer):
    model = load_draft_model(_draft(len(tokenizer)), len(tokenizer))
    proposer = DraftModelProposer(model)
    a = _Seq(0, tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    b = _Seq(1, tokenizer.encode("1, 2, 3,"))
    da, db = _check(proposer, model, [(a, 3), (b, 2)])
    a.token_ids += da[:2] + [17]  # two drafts accepted, then the target's own token
    b.token_ids += [db[0] + 1]  # the first draft rejected
    c = _Seq(2, tokenizer.encode("def add(a, b):\n    return"))  # joins
    da, _, dc = _check(proposer, model, [(a, 4), (b, 1), (c, 3)])
    a.token_ids += da  # all accepted (the bonus token is the target's: here the draft's last again)
    c.token_ids += dc[:1] + [5]
    _check(proposer, model, [(c, 2), (a, 1)])  # b left; another order
    proposer.forget({a.seq_id})
    assert list(proposer._states) == [a.seq_id]
    _check(proposer, model, [(c, 2)])  # a forgotten sequence starts over
