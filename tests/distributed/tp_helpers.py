"""Models, prompts and the TP=1-vs-TP=N comparison shared by the tensor-parallel tests (and by
torchrun_script.py, which imports this file by path)."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

# Two candidate tokens whose logits (fp32, the unsharded model) differ by less than this may swap places
# between TP=1 and TP=N: the all-reduce sums partial products in another order. The comparison accepts
# either token there, says so, and stops comparing that sequence (the paths differ from there on).
TIE_TOLERANCE = 1e-4
# Logits of TP=1 and TP=N: ~1e-5 relative apart from that order alone (SmolLM2's reach ~20, so an absolute
# bound alone sits at float32's rounding there: 14 of 196608 logits landed at 1.2e-4 once attention's
# 3-row blocks moved to 16 lanes, which sum in another order too). A wrong shard is off by whole units.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 2e-5
VOCAB = 512


def tiny_llama(seed: int = 0, **overrides):
    """A random fp32 Llama with 8 KV heads (16 query heads, head_dim 16). A non-trivial init scale, so greedy
    paths are not all one token; no eos, so every request runs to max_tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2),
                            **overrides})
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def prefix_sharing_prompts() -> list[list[int]]:
    """Lengths across block boundaries, and two prompts that share three full 16-token blocks with another."""
    prompts = random_prompts([1, 5, 16, 17, 33, 40, 64, 90])
    prompts.append(prompts[6][:48] + [7, 8, 9])
    prompts.append(prompts[7][:50] + [11])
    return prompts


def assert_same_greedy(reference_model, prompts, expected_outputs, outputs) -> int:
    """TP=N greedy tokens equal TP=1's, except at a near-tie of the unsharded model's logits (see
    TIE_TOLERANCE). reference_model: any copy of the unsharded weights. Returns the number of ties."""
    ties = 0
    hf = None
    for k, (prompt, want, got) in enumerate(zip(prompts, expected_outputs, outputs)):
        want, got = want.outputs[0].token_ids, got.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(want, got)):
            if a == b:
                continue
            if hf is None:  # only on a mismatch: the logits TP=1 chose from
                hf = copy.deepcopy(reference_model)
                hf.set_attn_implementation("sdpa")
            ids = prompt if isinstance(prompt, list) else None
            assert ids is not None, "pass prompts as token ids"
            with torch.no_grad():
                logits = hf(torch.tensor([ids + want[:i]])).logits[0, -1].float()
            gap = (logits[a] - logits[b]).item()
            assert abs(gap) < TIE_TOLERANCE, (f"prompt {k} token {i}: TP=1 chose {a}, TP=N {b}; logit gap {gap:.3g}"
                                              f" is no tie\nTP=1 {want}\nTP=N {got}")
            print(f"prompt {k} token {i}: near-tie (gap {gap:.2g}), accepted either token")
            ties += 1
            break
        else:
            assert len(want) == len(got), f"prompt {k}: TP=1 {want}\nTP=N {got}"
    return ties


def process_state(pid: int) -> str | None:
    """The /proc state letter of pid (R, S, T, Z, ...), or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[0]


def is_gone(pid: int) -> bool:
    """Exited: no process, or a zombie nobody has reaped yet (it holds no resources)."""
    return process_state(pid) in (None, "Z")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def generate_then_shut_down(llm, prompts, params):
    """(outputs, stats) of one generate call on a TP LLM, whose workers are shut down whatever happens."""
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.stats()
    finally:
        llm.shutdown()
