"""Every decoder family of docs/models.md's coverage table: kvpage.LLM against HF `generate` on the same small
random-weight model (tests/model/family_models.py, size "small": hidden 512, 4 layers, 8 query / 2 KV heads of
64, vocabulary 1024; the window families' windows 48-80 tokens), fp32, greedy.

Workload per family: BATCH prompts of PROMPT_LEN random tokens, NEW_TOKENS generated each (ignore_eos), so every
sequence outgrows its window. HF runs the batch as one `generate` call (equal lengths: no padding) with its own
cache and its fastest attention that computes the model (sdpa, else eager: Gemma 2's softcap and gpt-oss's
sinks need eager); kvpage runs the same prompts through LLM.generate (its own forward for Llama-family
models, HF's modules with kvpage attention for the rest; the model's KV-cache groups). Both first run a warm-up
of the same shapes. Then ROUNDS timed rounds, the two taking turns (kvpage first in even rounds, HF in odd
ones); the ratio is the median of per-round ratios of output tokens/s. "same tokens": kvpage's greedy tokens
equal HF's for every prompt.

    python bench/families.py                    # every family, 2 rounds
    python bench/families.py --families gemma2 mistral --rounds 3
    python bench/families.py --quick            # 2 prompts x 16 tokens, 1 round: a smoke run
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "model"))
from common import machine_info, print_table, wait_until_idle, write_json  # noqa: E402
from family_models import FAMILIES, NAMES, family_model, random_prompts  # noqa: E402

import kvpage  # noqa: E402
from kvpage.model import HFForward  # noqa: E402

BATCH, PROMPT_LEN, NEW_TOKENS, ROUNDS = 8, 128, 64, 2


def hf_attention(model) -> str:
    """sdpa where transformers runs this model on it, else eager."""
    try:
        model.set_attn_implementation("sdpa")
        return "sdpa"
    except (ValueError, NotImplementedError):
        model.set_attn_implementation("eager")
        return "eager"


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    # No eos (set off in bench_family): min_new_tokens would instead mask eos's logit, which kvpage's
    # ignore_eos does not, and the greedy paths would part wherever eos is the argmax.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         pad_token_id=0)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - start


def run_kvpage(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], time.perf_counter() - start


def bench_family(family: str, batch: int, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    reference = family_model(family, size="small")
    reference.generation_config.eos_token_id = None  # every sequence runs to new_tokens, as ignore_eos
    attention = hf_attention(reference)
    llm = kvpage.LLM(model=copy.deepcopy(reference), block_size=16, num_kv_blocks=batch * 3 * (
        -(-(prompt_len + new_tokens) // 16)) * 2, enable_prefix_caching=False)
    path = "HF modules + kvpage attention" if isinstance(llm.runner.forward, HFForward) else "kvpage's own forward"
    vocab = reference.config.vocab_size
    warm = random_prompts([prompt_len] * batch, seed=99, vocab=vocab)
    run_hf(reference, warm, new_tokens)
    run_kvpage(llm, warm, new_tokens)
    ratios, kv_rates, hf_rates, same = [], [], [], True
    for r in range(rounds):
        prompts = random_prompts([prompt_len] * batch, seed=r, vocab=vocab)
        wait_until_idle()
        order = (run_kvpage, run_hf) if r % 2 == 0 else (run_hf, run_kvpage)
        results = {fn: fn(llm if fn is run_kvpage else reference, prompts, new_tokens) for fn in order}
        (kv_tokens, kv_s), (hf_tokens, hf_s) = results[run_kvpage], results[run_hf]
        same &= kv_tokens == hf_tokens
        kv_rates.append(batch * new_tokens / kv_s)
        hf_rates.append(batch * new_tokens / hf_s)
        ratios.append(hf_s / kv_s)
        print(f"{family} round {r}: kvpage {kv_rates[-1]:.1f} tok/s, HF {hf_rates[-1]:.1f} tok/s,"
              f" {ratios[-1]:.2f}x", flush=True)
    return {"family": NAMES[family], "path": path, "HF attention": attention, "same tokens": same,
            "kvpage tok/s": round(statistics.median(kv_rates), 1), "HF tok/s": round(statistics.median(hf_rates), 1),
            "kvpage/HF": round(statistics.median(ratios), 2), "rounds": [round(x, 2) for x in ratios],
            "kv_cache_groups": llm.stats().get("kv_cache_groups")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens, 1 round (smoke run)")
    args = parser.parse_args()
    batch, prompt_len, new_tokens = (2, 32, 16) if args.quick else (BATCH, PROMPT_LEN, NEW_TOKENS)
    rounds = 1 if args.quick else args.rounds
    rows = [bench_family(f, batch, prompt_len, new_tokens, rounds) for f in args.families]
    columns = ["family", "path", "HF attention", "same tokens", "kvpage tok/s", "HF tok/s", "kvpage/HF", "rounds"]
    print_table(rows, columns)
    path = write_json("families", {"machine": machine_info(), "batch": batch, "prompt_len": prompt_len,
                                   "new_tokens": new_tokens, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
