"""kvpage in a hand-written decode loop: a Llama forward pass of twenty lines over the paged KV cache.

No engine and no HF cache: K/V live in tensors from `ops.allocate_kv_cache`, the block tables come from
the block manager, and every attention layer calls the ops itself. `reshape_and_cache` writes the step's
K/V into their slots; `paged_prefill_attention` (the prompts) and `paged_attention` (one new token per
sequence) read the cache back through the block tables. The sequences of a step run as one flat batch
of tokens, back to back, without padding. Weights are the HF model's; the output equals greedy
`model.generate`, which the script checks.

    python examples/paged_decode_loop.py [--model DIR] [--max-new-tokens 24] [--quick]
"""
from __future__ import annotations

import argparse

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpage import ops
from kvpage.core import BlockManager, Sequence
from kvpage.model import load_model

BLOCK_SIZE = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def forward(model, kv_caches, tokens, positions, slots, block_tables, seq_lens, query_start_loc):
    """Hidden states [T, hidden] of a flat batch of T tokens; prompts (prefill) or one token per sequence."""
    llama = model.model
    h = llama.embed_tokens(tokens)
    cos, sin = llama.rotary_emb(h, positions[None])
    decode = len(tokens) == len(seq_lens)  # one token per sequence: the decode kernel
    for layer, (key_cache, value_cache) in zip(llama.layers, kv_caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = (proj(x).view(len(tokens), -1, attn.head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)  # [T, heads, head_dim]
        ops.reshape_and_cache(k, v, key_cache, value_cache, slots)  # this step's K/V into its slots
        if decode:
            o = ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=attn.scaling)
        else:
            o = ops.paged_prefill_attention(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                            scale=attn.scaling)
        h = h + attn.o_proj(o.flatten(1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return llama.norm(h)


def step(model, kv_caches, manager: BlockManager, seqs: list[Sequence]) -> None:
    """Run every sequence's uncomputed tokens (the whole prompt, or the last token) and append the argmax."""
    tokens, positions, slots, tables, seq_lens, starts, copies = [], [], [], [], [], [0], []
    for seq in seqs:
        start, end = seq.num_computed_tokens, len(seq.token_ids)
        if start:  # decode: room for one more token (a new block once the last is full)
            copies += manager.append_slots(seq, end - start)  # copy-on-write pairs: only if blocks were shared
        tokens += seq.token_ids[start:end]
        positions += range(start, end)
        slots += manager.slot_mapping(seq, start, end)
        tables.append(seq.block_table)
        seq_lens.append(end)
        starts.append(len(tokens))
    if copies:
        ops.copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], copies)
    width = max(len(t) for t in tables)
    block_tables = [t + [0] * (width - len(t)) for t in tables]
    hidden = forward(model, kv_caches, _long(tokens), _long(positions), _long(slots), _int(block_tables),
                     _int(seq_lens), _int(starts))
    logits = model.lm_head(hidden[[s - 1 for s in starts[1:]]])  # each sequence's last token
    for seq, token in zip(seqs, logits.argmax(-1).tolist()):
        manager.mark_computed(seq, len(seq.token_ids) - seq.num_computed_tokens)
        seq.append_token(token)


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _int(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of each prompt (token ids); the new tokens of each."""
    config = model.config
    num_blocks = sum(-(-(len(p) + max_new_tokens) // BLOCK_SIZE) for p in prompts)  # enough for every sequence
    kv_caches = [ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                                       dtype=model.dtype) for _ in range(config.num_hidden_layers)]
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    for seq in seqs:
        manager.allocate(seq)  # blocks for the whole prompt
    for _ in range(max_new_tokens):
        step(model, kv_caches, manager, seqs)
    return [seq.output_token_ids for seq in seqs]


def main(argv=None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local Llama-family HF model directory (default: the"
                        " embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="4 new tokens (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens = 4
    model, tokenizer = load_model(args.model)  # default: SmolLM2-135M-Instruct (a Llama), fp32
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outputs = generate(model, prompts, args.max_new_tokens)
    same = True
    model.set_attn_implementation("sdpa")  # the reference: HF's own attention and cache
    for prompt, text, output in zip(prompts, PROMPTS, outputs):
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
        same &= want[0, len(prompt):].tolist() == output
        print(f"{text!r} -> {tokenizer.decode(output)!r}")
    print(f"same tokens as greedy model.generate: {same}")
    return same


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
