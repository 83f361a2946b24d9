"""`kvpage serve` under attack (issue 49): while NUM_STREAMS authenticated streams decode, ATTACKERS clients
send 10 MB request bodies (answered 413 by the body limit) and unauthenticated 5 MB /tokenize calls (401).
Reported: the streams' inter-token gaps (p50 / p99 over every gap of every stream, the first token's wait
left out), with and without the attack, in alternating rounds; the target is p99 under attack <= 2x.

The attackers run in their own process (threads writing raw HTTP over sockets), each sending one request,
reading its answer and pausing ATTACK_PAUSE_S before the next: a hostile client, not a bandwidth flood
(on loopback that would only measure how fast the kernel copies bytes on a 2-core machine).

    python bench/serve_attack.py            # the default model, 64 streams x 32 tokens, 2 rounds
    python bench/serve_attack.py --quick    # a tiny random model (seconds)

Writes bench/results/serve_attack.json (serve_attack_quick.json) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import machine_info, print_table, write_json  # noqa: E402
from serve import requests_for  # noqa: E402
from serve_servers import MODEL_NAME, ROOT, start_server, tiny_model_dir  # noqa: E402

from kvpage.engine.workload import percentile  # noqa: E402

API_KEY = "bench-key"
NUM_STREAMS = 64
ATTACKERS = 8
ATTACK_PAUSE_S = 0.1
BIG_BODY = 10 << 20
TOKENIZE_BODY = 5 << 20


# -- the attackers (their own process) -----------------------------------------------------------

def _raw_post(host: str, port: int, path: str, body: bytes, headers: dict) -> int:
    """One HTTP/1.1 POST over a fresh socket; the status code (0 if the connection broke)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", "Content-Type": "application/json",
                                                 "Content-Length": str(len(body)), "Connection": "close",
                                                 **headers}.items())
    try:
        with socket.create_connection((host, port), timeout=60) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body)
            answer = b""
            while b"\r\n" not in answer:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
        return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    except OSError:
        return 0


def _attacker(host: str, port: int, stop, counts, i: int) -> None:
    big = b'{"prompt": "' + b"word " * ((BIG_BODY - 14) // 5) + b'"}'
    tokenize = b'{"prompt": "' + b"word " * ((TOKENIZE_BODY - 14) // 5) + b'"}'
    while not stop.is_set():
        if i % 2 == 0:
            status = _raw_post(host, port, "/v1/completions", big, {"Authorization": f"Bearer {API_KEY}"})
        else:
            status = _raw_post(host, port, "/tokenize", tokenize, {})  # no key
        counts.append(status)
        i += 1
        stop.wait(ATTACK_PAUSE_S)


def attack_process(host: str, port: int, stop, ready, results) -> None:
    counts: list[int] = []
    threads = [threading.Thread(target=_attacker, args=(host, port, stop, counts, i)) for i in range(ATTACKERS)]
    for t in threads:
        t.start()
    while len(counts) < ATTACKERS and not stop.is_set():  # every attacker has been answered once
        time.sleep(0.01)
    ready.set()
    for t in threads:
        t.join()
    results.put(counts)


# -- the streams ---------------------------------------------------------------------------------

async def _stream(client, prompt: list[int], output_len: int) -> list[float]:
    """The gaps between one stream's tokens (after its first)."""
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=output_len, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    times = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def _streams(url: str, prompts: list, output_len: int) -> list[float]:
    import openai
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=600) as client:
        gaps = await asyncio.gather(*(_stream(client, p, output_len) for p in prompts))
    return [g for stream in gaps for g in stream]


def run_phase(url: str, prompts: list, output_len: int, attack: bool) -> dict:
    stop, results, process = None, None, None
    if attack:
        ctx = multiprocessing.get_context("fork")  # the child runs sockets and threads only
        stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
        host, port = url.removeprefix("http://").split(":")
        process = ctx.Process(target=attack_process, args=(host, int(port), stop, ready, results))
        process.start()
        if not ready.wait(timeout=120):  # the attack is under way before the streams start
            raise RuntimeError("the attackers got no answer in 120 s")
    started = time.perf_counter()
    gaps = sorted(asyncio.run(_streams(url, prompts, output_len)))
    seconds = time.perf_counter() - started
    out = {"attack": attack, "seconds": seconds, "gaps": len(gaps), "gap_p50_s": percentile(gaps, 50),
           "gap_p99_s": percentile(gaps, 99), "gap_max_s": gaps[-1]}
    if attack:
        stop.set()
        statuses = results.get(timeout=120)
        process.join(timeout=60)
        out["attack_requests"] = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    return out


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random model")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        from kvpage.model.loader import default_model_dir
        model_dir = tiny_model_dir(Path(tmp)) if args.quick else default_model_dir()
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
        server = start_server("kvpage serve", lambda port: [
            sys.executable, "-m", "kvpage", "serve", str(model_dir), "--port", str(port), "--served-model-name",
            MODEL_NAME, "--api-key", API_KEY], env, Path(tmp))
        try:
            run_phase(server.url, requests_for(tok, NUM_STREAMS, args.input_len, 999), 4, attack=False)  # warm-up
            phases = []
            for r in range(args.rounds):
                for attack in ((False, True) if r % 2 == 0 else (True, False)):
                    prompts = requests_for(tok, NUM_STREAMS, args.input_len, 2 * r + attack)
                    phases.append({"round": r, **run_phase(server.url, prompts, args.output_len, attack)})
                    print(phases[-1], flush=True)
        finally:
            server.stop()
    quiet = [p for p in phases if not p["attack"]]
    attacked = [p for p in phases if p["attack"]]
    ratio = statistics.median(a["gap_p99_s"] / q["gap_p99_s"] for a, q in zip(attacked, quiet))
    res = {"workload": {"streams": NUM_STREAMS, "input_len": args.input_len, "output_len": args.output_len,
                        "attackers": ATTACKERS, "attack_pause_s": ATTACK_PAUSE_S, "big_body_bytes": BIG_BODY,
                        "tokenize_body_bytes": TOKENIZE_BODY,
                        "model": "tiny random Llama" if args.quick else "SmolLM2-135M-Instruct"},
           "machine": machine_info(), "phases": phases, "p99_gap_ratio_attack_over_quiet": ratio}
    print_table([{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in p.items() if k != "attack_requests"}
                 for p in phases], ["round", "attack", "seconds", "gaps", "gap_p50_s", "gap_p99_s", "gap_max_s"])
    print(f"p99 inter-token gap, attack / quiet (median over rounds): {ratio:.2f}x (target <= 2x)")
    write_json("serve_attack_quick" if args.quick else "serve_attack", res)
    return res


if __name__ == "__main__":
    main()
