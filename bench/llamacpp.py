"""kvpage vs llama.cpp on llama.cpp's own batched benchmark (llama-batched-bench).

The job: npl sequences share one pp-token prompt, then each generates tg tokens, all sequences decoding
together. llama.cpp runs its tool with -pps (the shared prompt computed once), flash attention on, F32
weights (the default model's Q4_1 GGUF requantized to F32 by llama-quantize: the weights kvpage
dequantizes and loads), the same thread count, in both of its KV layouts: the prompt copied into every
sequence's cells, and one unified buffer (-kvu) that every sequence attends over with a mask; each
round takes llama.cpp's faster layout per npl. It feeds random tokens and samples nothing. kvpage runs the same job as an ordinary engine call: LLM.generate on npl copies of a
random pp-token prompt, tg greedy tokens each (ignore_eos), prefix caching on (the copies share the
prompt's blocks), so its time also covers scheduling, sampling and detokenising.

Reported per npl: output tokens/s over the whole job, npl * tg / (prompt + generation seconds), for both
(llama.cpp's `pl * tg / t`), and the generation-only rate beside it for both: llama.cpp's S_TG, and kvpage's
tokens after each sequence's first over the seconds after the last first token (the prompt's step produces
the first token); kvpage/llama.cpp of each as the median of the per-round ratios.

--chat runs a single-stream chat-shaped job instead: one CHAT_PROMPT-token prompt, CHAT_TOKENS tokens out,
through LLM.generate, through `kvpage serve` (its own process, one streamed /v1/completions request from the
openai client, as bench/serve.py drives it) and through llama-batched-bench at npl 1 with that prompt and
output length; per round each in turn, reported whole-job and generation-only tokens/s and time to first
token. The two alternate, ROUNDS rounds each (this machine's speed drifts by +-15%
over minutes); every round and npl has its own prompt, so nothing carries over in kvpage's prefix cache.

    bash bench/peers/setup_llamacpp.sh   # once: builds llama.cpp (~20 min on 2 cores), F32 + BF16 models
    python bench/llamacpp.py             # npl 32, 48, 64; pp 128; tg 128; 3 rounds
    python bench/llamacpp.py --weight-dtype bfloat16 --npl 1,4,16,64 [--matmul-precision medium]
                                         # kvpage's 16-bit weights (and bf16 dot products) vs llama.cpp BF16
    python bench/llamacpp.py --chat      # one stream: 500-token prompt, 256 tokens out; generate, serve, llama.cpp
    python bench/llamacpp.py --quick     # npl 4, pp 32, tg 8, 1 round: a smoke run

Without llama.cpp (no setup_llamacpp.sh run) kvpage's side runs alone, and the script says so.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402
import serve_servers  # noqa: E402
from common import (QUICK_ENGINE_ARGS, add_model_argument, machine_info, model_dir, print_table,  # noqa: E402
                    random_prompt, write_json)
from peers.llamacpp_launcher import available, llamacpp_dir, model_file, run_batched_bench  # noqa: E402

import kvpage  # noqa: E402
from kvpage.engine.workload import Workload, run_kvpage  # noqa: E402

ROUNDS = 3
CHAT_PROMPT, CHAT_TOKENS = 500, 256


def output_tok_s(row: dict) -> float:
    """llama-batched-bench's row as output tokens over the whole job (prompt + generation)."""
    return row["pl"] * row["tg"] / row["t"]


def generation_tok_s(tokens: int, sequences: int, seconds: float, last_first_token_s: float) -> float:
    """Decode tokens/s without the prompt: the tokens after each sequence's first (which the prompt's step
    makes) over the time after the last first token, as llama.cpp's S_TG leaves its prompt out."""
    return (tokens - sequences) / max(seconds - last_first_token_s, 1e-9)


def run_ours(llm, pp: int, tg: int, npl: int, seed: int) -> dict:
    prompt = random_prompt(llm.tokenizer, pp, seed)
    res = run_kvpage(llm, Workload([list(prompt) for _ in range(npl)], [tg] * npl))
    outputs = res.pop("outputs")
    last_first = max(o.metrics["ttft"] for o in outputs)
    res["generation_tok_s"] = generation_tok_s(res["output_tokens"], npl, res["seconds"], last_first)
    return res


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--npl", default="32,48,64", help="comma list: sequences decoding together")
    parser.add_argument("--pp", type=int, default=128, help="shared prompt tokens")
    parser.add_argument("--tg", type=int, default=128, help="generated tokens per sequence")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--weight-dtype", choices=("auto", "bfloat16"), default="auto",
                        help="bfloat16: kvpage's weight_dtype='bfloat16' (16-bit weights, fp32 compute)"
                        " against llama.cpp's BF16 model")
    parser.add_argument("--matmul-precision", choices=("highest", "medium"), default="highest",
                        help="kvpage's matmul_precision (medium: bf16 dot products, as llama.cpp's BF16 model)")
    parser.add_argument("--chat", action="store_true", help=f"one stream, a {CHAT_PROMPT}-token prompt and"
                        f" {CHAT_TOKENS} tokens out, through LLM.generate, kvpage serve and llama.cpp")
    parser.add_argument("--quick", action="store_true", help="npl 4, pp 32, tg 8, 1 round (smoke run)")
    add_model_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.npl, args.pp, args.tg, args.rounds = "4", 32, 8, 1
    if args.chat:
        return chat_main(args)
    npls = [int(x) for x in args.npl.split(",") if x]
    torch.set_num_threads(args.threads)
    weight_type = "BF16" if args.weight_dtype == "bfloat16" else "F32"
    with_peer = available(weight_type)
    if not with_peer:
        print(f"llama.cpp skipped: no llama-batched-bench and {weight_type} model under {llamacpp_dir()}"
              f" (bash bench/peers/setup_llamacpp.sh makes them); kvpage runs alone", flush=True)

    llm = kvpage.LLM(model=args.model, **_engine_options(args))
    run_ours(llm, args.pp, args.tg, max(npls), seed=10_000)  # warm-up: same shapes, other tokens
    ours = {n: [] for n in npls}
    theirs = {n: [] for n in npls}
    for r in range(args.rounds):
        for n in npls:
            ours[n].append(run_ours(llm, args.pp, args.tg, n, seed=100 * r + n))
            print(f"round {r} kvpage npl={n}: {ours[n][-1]['output_tok_s']:.1f} output tok/s", flush=True)
        if not with_peer:
            continue
        layouts = {unified: run_batched_bench(args.pp, args.tg, npls, args.threads, unified, weight_type=weight_type)
                   for unified in (False, True)}
        for split_row, unified_row in zip(layouts[False], layouts[True]):
            for row, name in ((split_row, "per-sequence KV"), (unified_row, "unified KV")):
                row["layout"] = name
                print(f"round {r} llama.cpp npl={row['pl']} {name}: {output_tok_s(row):.1f} output tok/s"
                      f" (S_TG {row['speed_tg']:.1f})", flush=True)
            theirs[split_row["pl"]].append(max(split_row, unified_row, key=output_tok_s))
    return report(args, npls, ours, theirs)


def _engine_options(args) -> dict:
    return {"weight_dtype": args.weight_dtype, "matmul_precision": args.matmul_precision,
            **(QUICK_ENGINE_ARGS if args.quick else {})}


def chat_generate(llm, pp: int, tg: int, seed: int) -> dict:
    """One stream through LLM.generate."""
    res = run_ours(llm, pp, tg, 1, seed)
    return {"output_tok_s": res["output_tok_s"], "generation_tok_s": res["generation_tok_s"],
            "ttft_s": res["ttft_p50_s"]}


def chat_served(url: str, tokenizer, pp: int, tg: int, seed: int) -> dict:
    """One stream through `kvpage serve`: a streamed /v1/completions request (bench/serve.py's client)."""
    (one,) = asyncio.run(serve._drive(url, [list(random_prompt(tokenizer, pp, seed))], tg, None, seed))
    seconds = one["end"] - one["start"]
    return {"output_tok_s": one["tokens"] / seconds,
            "generation_tok_s": generation_tok_s(one["tokens"], 1, seconds, one["ttft"]), "ttft_s": one["ttft"]}


def chat_llamacpp(pp: int, tg: int, threads: int, weight_type: str) -> dict:
    (row,) = run_batched_bench(pp, tg, [1], threads, False, weight_type=weight_type)
    return {"output_tok_s": output_tok_s(row), "generation_tok_s": row["speed_tg"], "ttft_s": row["t_pp"]}


def start_server(args, log_dir: Path) -> "serve_servers.Server":
    flags = ["--weight-dtype", args.weight_dtype, "--matmul-precision", args.matmul_precision]
    if args.quick:
        flags += ["--num-kv-blocks", str(QUICK_ENGINE_ARGS["num_kv_blocks"]), "--swap-space-gib", "0"]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(serve_servers.ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    return serve_servers.start_server("kvpage serve", lambda port: [
        sys.executable, "-m", "kvpage", "serve", str(model_dir(args.model)), "--port", str(port),
        "--served-model-name", serve_servers.MODEL_NAME, *flags], env, log_dir)


def chat_main(args) -> dict:
    """The single-stream chat-shaped job (--chat): each system in turn per round, medians reported."""
    pp, tg = (32, 8) if args.quick else (CHAT_PROMPT, CHAT_TOKENS)
    torch.set_num_threads(args.threads)
    weight_type = "BF16" if args.weight_dtype == "bfloat16" else "F32"
    llm = kvpage.LLM(model=args.model, **_engine_options(args))
    runs = {"kvpage LLM.generate": [], "kvpage serve": [], "llama.cpp": []}
    with tempfile.TemporaryDirectory() as log_dir:
        server = start_server(args, Path(log_dir))
        try:
            chat_generate(llm, pp, tg, seed=10_000)  # warm-ups: same shapes, other tokens
            chat_served(server.url, llm.tokenizer, pp, tg, seed=10_001)
            for r in range(args.rounds):
                runs["kvpage LLM.generate"].append(chat_generate(llm, pp, tg, seed=2 * r))
                runs["kvpage serve"].append(chat_served(server.url, llm.tokenizer, pp, tg, seed=2 * r + 1))
                if available(weight_type):
                    runs["llama.cpp"].append(chat_llamacpp(pp, tg, args.threads, weight_type))
                print(f"round {r}: " + ", ".join(f"{name} {v[-1]['generation_tok_s']:.1f} gen tok/s"
                                                 for name, v in runs.items() if v), flush=True)
        finally:
            server.stop()
    med = statistics.median
    rows = [{"system": name, "tok/s (whole job)": f"{med(r['output_tok_s'] for r in v):.1f}",
             "generation tok/s": f"{med(r['generation_tok_s'] for r in v):.1f}",
             "TTFT ms": f"{med(r['ttft_s'] for r in v) * 1e3:.0f}"} for name, v in runs.items() if v]
    if runs["llama.cpp"]:
        for row, (name, v) in zip(rows, runs.items()):
            ratios = [a["generation_tok_s"] / b["generation_tok_s"] for a, b in zip(v, runs["llama.cpp"])]
            row["gen vs llama.cpp"] = f"{med(ratios):.2f}x (rounds " + ", ".join(f"{x:.2f}" for x in ratios) + ")"
    print(f"\none stream: {pp}-token prompt, {tg} tokens out, {args.threads} threads, kvpage weight_dtype="
          f"{args.weight_dtype} matmul_precision={args.matmul_precision}")
    print_table(rows, list(rows[0]))
    payload = {"pp": pp, "tg": tg, "threads": args.threads, "rounds": args.rounds,
               "weight_dtype": args.weight_dtype, "matmul_precision": args.matmul_precision,
               "machine": machine_info(), "runs": runs}
    write_json(f"llamacpp_chat{_suffix(args)}{'_quick' if args.quick else ''}", payload)
    return payload


def _suffix(args) -> str:
    return ("" if args.weight_dtype == "auto" else f"_{args.weight_dtype}") + \
        ("_medium" if args.matmul_precision == "medium" else "")


def report(args, npls, ours, theirs) -> dict:
    """theirs[n] is empty where llama.cpp did not run: the rows then hold kvpage's figures alone."""
    rows, results = [], []
    med = statistics.median  # of an even number of rounds: the mean of the middle two
    for n in npls:
        kv = [o["output_tok_s"] for o in ours[n]]
        kv_gen = [o["generation_tok_s"] for o in ours[n]]
        results.append({"npl": n, "kvpage_output_tok_s": kv, "kvpage_generation_tok_s": kv_gen,
                        "kvpage_ttft_p50_s": [o["ttft_p50_s"] for o in ours[n]],
                        "kvpage_prefix_cache_hit_rate": [o["prefix_cache_hit_rate"] for o in ours[n]]})
        rows.append({"npl": n, "kvpage tok/s": f"{med(kv):.1f}", "kvpage gen tok/s": f"{med(kv_gen):.1f}"})
        if theirs[n]:
            ll = [output_tok_s(t) for t in theirs[n]]
            ll_gen = [t["speed_tg"] for t in theirs[n]]
            ratios = [a / b for a, b in zip(kv, ll)]
            gen_ratios = [a / b for a, b in zip(kv_gen, ll_gen)]
            results[-1].update({"llamacpp_output_tok_s": ll, "llamacpp_s_tg": ll_gen,
                                "llamacpp_layout": [t["layout"] for t in theirs[n]],
                                "speedup_rounds": ratios, "speedup": med(ratios),
                                "generation_speedup_rounds": gen_ratios, "generation_speedup": med(gen_ratios),
                                "llamacpp_rows": theirs[n]})
            rows[-1].update({"llama.cpp tok/s": f"{med(ll):.1f}",
                             "llama.cpp layout": "/".join(sorted({t["layout"] for t in theirs[n]})),
                             "llama.cpp S_TG": f"{med(ll_gen):.1f}",
                             "kvpage/llama.cpp": f"{med(ratios):.2f}x (rounds "
                             + ", ".join(f"{x:.2f}" for x in ratios) + ")",
                             "generation-only": f"{med(gen_ratios):.2f}x (rounds "
                             + ", ".join(f"{x:.2f}" for x in gen_ratios) + ")"})
    weight_type = "BF16" if args.weight_dtype == "bfloat16" else "F32"
    print(f"\npp {args.pp}, tg {args.tg}, {args.threads} threads, kvpage weight_dtype={args.weight_dtype}"
          f" matmul_precision={args.matmul_precision},"
          f" model {getattr(model_file(weight_type), 'name', 'none')} for llama.cpp")
    print_table(rows, ["npl", "kvpage tok/s", "llama.cpp tok/s", "kvpage/llama.cpp", "kvpage gen tok/s",
                       "llama.cpp S_TG", "generation-only", "llama.cpp layout"])
    payload = {"pp": args.pp, "tg": args.tg, "threads": args.threads, "rounds": args.rounds,
               "weight_dtype": args.weight_dtype, "matmul_precision": args.matmul_precision,
               "machine": machine_info(), "results": results}
    write_json(f"llamacpp{_suffix(args)}{'_quick' if args.quick else ''}", payload)
    return payload


if __name__ == "__main__":
    main()
