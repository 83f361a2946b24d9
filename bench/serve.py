"""Serving throughput and latency: `kvpage serve` driven over HTTP, against offline LLM.generate on the
same requests (what the HTTP layer costs).

Workload, as `vllm bench serve --dataset-name random`: NUM_PROMPTS prompts of INPUT_LEN random ordinary
token ids (no shared prefix, so the prefix cache has nothing to reuse) and OUTPUT_LEN output tokens each
(ignore_eos), greedy, sent as token ids to /v1/completions with stream=true. The client (asyncio + the
openai client, in this process) sends every request at once (saturation) or at a Poisson rate of half the
saturated request rate (moderate), and records per request the time to its first token (TTFT), the time per
output token after it (TPOT) and its end. The server runs as `python -m kvpage serve` in its own process;
offline LLM.generate runs here, on the same model and the same requests.

This shared machine's speed drifts, so offline and the saturated server take turns: ROUNDS rounds of one
offline run then one server run, each round on its own prompts (another seed: no round reads another's
prefix cache), after a warm-up of each. Reported: each side's median round, and server/offline as the
median of the per-round ratios. The moderate rate runs once, after them.

vLLM's `vllm serve` is not run here: its venv (bench/peers/setup_vllm.sh) is not set up on this machine.

    python bench/serve.py           # the default model: 32 requests x 128 prompt + 32 output tokens, 3 rounds
    python bench/serve.py --quick   # a tiny random model, 8 short requests: a smoke test (seconds)

Writes bench/results/serve.json (serve_quick.json) and serve.png and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import RESULTS_DIR, machine_info, print_table, random_prompt, wait_until_idle, write_json  # noqa: E402

import kvpage  # noqa: E402
from kvpage.engine.workload import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench"
ROUNDS = 3


def tiny_model_dir(directory: Path) -> Path:
    """A random 2-layer Llama over the default model's tokenizer, saved as an HF directory (--quick)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvpage.model.loader import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def requests_for(tokenizer, num: int, input_len: int, seed: int) -> list[list[int]]:
    return [random_prompt(tokenizer, input_len, seed * 100_000 + i) for i in range(num)]


# -- offline -------------------------------------------------------------------------------------

def run_offline(llm, prompts: list, output_len: int) -> dict:
    """LLM.generate in a thread of its own, as the server's engine loop runs: on this shared 2-core
    machine the main thread's torch ops ran 5-10x slower than the same ops in another thread (2 OpenMP
    threads there; 1 on the main thread matched the other thread), which would be no HTTP cost."""
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    result = []
    thread = threading.Thread(target=lambda: result.append(llm.generate(prompts, params, use_tqdm=False)))
    start = time.perf_counter()
    thread.start()
    thread.join()
    seconds = time.perf_counter() - start
    outputs = result[0]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = sorted(o.metrics["ttft"] for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "req_s": len(prompts) / seconds, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


# -- the server and its client -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "kvpage", "serve", str(model_dir), "--port", str(port),
                                "--served-model-name", MODEL_NAME], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("kvpage serve exited while starting")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return process, url
        except OSError:
            time.sleep(0.25)
    process.terminate()
    raise RuntimeError("kvpage serve did not come up in 300 s")


async def _one(client, prompt: list[int], output_len: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=output_len, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first if first is not None else end
    return {"start": start, "end": end, "ttft": first - start, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


async def _drive(url: str, prompts: list, output_len: int, rate: float | None, seed: int) -> list[dict]:
    import openai

    rng, delays, t = random.Random(seed), [], 0.0
    for _ in prompts:  # Poisson arrivals at `rate` per second; all at once without one
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600) as client:
        return await asyncio.gather(*(_one(client, p, output_len, d) for p, d in zip(prompts, delays)))


def summarise(results: list[dict]) -> dict:
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    tpots = sorted(r["tpot"] for r in results if r["tpot"] is not None)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "req_s": len(results) / seconds, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99)}


def run_server(url: str, prompts: list, output_len: int, rate: float | None = None) -> dict:
    return summarise(asyncio.run(_drive(url, prompts, output_len, rate, seed=0)))


def median_run(runs: list[dict]) -> dict:
    """The run of the median output tok/s (of an even number, the slower middle one)."""
    return sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]


def run_rounds(model_dir: Path, requests, output_len: int, rounds: int) -> dict:
    """Offline and the saturated server in turns, then the server at half its saturated request rate."""
    llm = kvpage.LLM(model=str(model_dir))
    process, url = start_server(model_dir)
    try:
        warmup = requests(seed=99)[:8]
        run_offline(llm, warmup, output_len)
        run_server(url, warmup, output_len)
        offline, server = [], []
        for r in range(rounds):
            prompts = requests(seed=r + 1)
            wait_until_idle(max_seconds=5)  # the other side's threads may spin on after its run
            offline.append(run_offline(llm, prompts, output_len))
            wait_until_idle(max_seconds=5)
            server.append(run_server(url, prompts, output_len))
        ratios = sorted(s["output_tok_s"] / o["output_tok_s"] for s, o in zip(server, offline))
        rate = median_run(server)["req_s"] / 2
        wait_until_idle(max_seconds=5)
        moderate = run_server(url, requests(seed=rounds + 1), output_len, rate)
        moderate["request_rate"] = rate
    finally:
        process.terminate()
        process.wait(timeout=60)
        llm.shutdown()
    mid = len(ratios) // 2
    return {"offline": median_run(offline), "server": {"saturation": median_run(server), "moderate": moderate},
            "server_vs_offline": ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2,
            "server_vs_offline_rounds": ratios, "rounds": {"offline": offline, "server": server}}


# -- report --------------------------------------------------------------------------------------

def report(res: dict, name: str) -> None:
    def fmt(r: dict) -> dict:
        return {k: (f"{v:.3f}" if k.startswith(("ttft", "tpot")) else f"{v:.1f}") for k, v in r.items()
                if isinstance(v, float)}
    rows = [{"run": "offline LLM.generate", **fmt(res["offline"])},
            {"run": "kvpage serve, saturation", **fmt(res["server"]["saturation"])},
            {"run": f"kvpage serve, {res['server']['moderate']['request_rate']:.2f} req/s",
             **fmt(res["server"]["moderate"])}]
    print_table(rows, ["run", "output_tok_s", "req_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"])
    print(f"server at saturation / offline: {res['server_vs_offline']:.2f}x output tok/s (median of rounds "
          + ", ".join(f"{r:.2f}" for r in res["server_vs_offline_rounds"]) + ")")
    write_json(name, res)
    plot(rows, res, RESULTS_DIR / f"{name}.png")


def plot(rows: list[dict], res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [res["offline"], res["server"]["saturation"], res["server"]["moderate"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([r["run"].replace(", ", "\n") for r in rows], [r["output_tok_s"] for r in runs], color="tab:blue")
    a.set_ylabel("output tokens / s")
    a.set_title(f"server / offline = {res['server_vs_offline']:.2f}x")
    labels = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    for i, (label, r) in enumerate(zip(["saturation", "moderate"], runs[1:])):
        values = [r["ttft_p50_s"], r["ttft_p99_s"], r["tpot_p50_s"], r["tpot_p99_s"]]
        b.bar([x + 0.4 * i for x in range(4)], values, width=0.4, label=label)
    b.set_xticks([x + 0.2 for x in range(4)], labels)
    b.set_yscale("log")
    b.set_ylabel("seconds")
    b.legend()
    fig.suptitle(f"kvpage serve: {res['workload']['num_prompts']} requests x {res['workload']['input_len']} +"
                 f" {res['workload']['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random model, 8 short requests")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help=f"default {ROUNDS}, 1 with --quick")
    args = parser.parse_args()
    num, input_len, output_len = (8, 32, 8) if args.quick else (32, 128, 32)
    num, input_len, output_len = args.num_prompts or num, args.input_len or input_len, args.output_len or output_len
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        from kvpage.model.loader import default_model_dir
        model_dir = tiny_model_dir(Path(tmp)) if args.quick else default_model_dir()
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        res = {"workload": {"num_prompts": num, "input_len": input_len, "output_len": output_len,
                            "model": "tiny random Llama" if args.quick else "SmolLM2-135M-Instruct"},
               "machine": machine_info()}
        res.update(run_rounds(model_dir, lambda seed: requests_for(tok, num, input_len, seed), output_len,
                              args.rounds or (1 if args.quick else ROUNDS)))
    report(res, "serve_quick" if args.quick else "serve")
    return res


if __name__ == "__main__":
    main()
