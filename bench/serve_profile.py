"""Where `kvpage serve` loses throughput against offline LLM.generate at saturation (issue 47).

One process, one LLM, paired runs on the same requests: offline LLM.generate (in a thread, as bench/serve.py
runs it), then the server app over that LLM (uvicorn in a thread, the engine loop in another: the threads of
`kvpage serve`), driven by a minimal raw-HTTP streaming client in a subprocess (so that the client's own CPU
is counted apart). Each run records:

- wall time and output tokens/s;
- every engine step's time, its forward pass (runner.execute) and its output processing (_process:
  incremental detokenization, RequestOutputs), with the step's batch: decode steps of the same batch size
  compare the same work, so a slower step in the server is interference (the GIL, OpenMP's team waiting
  for a core), not more work;
- CPU seconds per thread (engine / event loop / tokenizer pool / OpenMP workers), from /proc, and the
  client's;
- the engine loop's time outside steps (commands, stats publishing, handing outputs over).

    python bench/serve_profile.py                       # 64 x 256 + 128, 2 paired rounds
    python bench/serve_profile.py --py-spy /tmp/spy.txt # and py-spy's raw per-thread stacks of the server runs
    python bench/serve_profile.py --quick               # a tiny random model, 4 short requests (seconds)

Prints one JSON line per run and writes them to bench/results/serve_profile.json (serve_profile_quick.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


# -- the client (a subprocess) --------------------------------------------------------------------

async def _one(port: int, prompt: list[int], output_len: int) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    start, first, chunks = time.perf_counter(), None, 0
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            chunks += 1
            if first is None:
                first = time.perf_counter()
    writer.close()
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "end": end, "start": start, "chunks": chunks}


async def _client(port: int, prompts: list, output_len: int) -> list[dict]:
    return await asyncio.gather(*(_one(port, p, output_len) for p in prompts))


def client_main(argv: list[str]) -> None:
    port, output_len, path = int(argv[0]), int(argv[1]), argv[2]
    prompts = json.loads(Path(path).read_text())
    results = asyncio.run(_client(port, prompts, output_len))
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"results": results, "cpu_s": ru.ru_utime + ru.ru_stime}))


# -- instrumentation -------------------------------------------------------------------------------

class StepLog:
    """Wraps the engine's step, the runner's forward and the output processing with timers."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rows: list[dict] = []
        self._current: dict = {}
        runner_execute, process, step = engine.runner.execute, engine._process, engine.step

        def timed_execute(out):
            t = time.perf_counter()
            try:
                return runner_execute(out)
            finally:
                self._current.update(execute=time.perf_counter() - t, tokens=out.num_batched_tokens,
                                     seqs=out.num_seqs)

        def timed_process(rows):
            t = time.perf_counter()
            try:
                return process(rows)
            finally:
                self._current["process"] = time.perf_counter() - t

        def timed_step():
            self._current = {}
            t, c = time.perf_counter(), time.thread_time()
            try:
                return step()
            finally:
                self._current.update(step=time.perf_counter() - t, step_cpu=time.thread_time() - c, at=t)
                self.rows.append(self._current)

        engine.runner.execute, engine._process, engine.step = timed_execute, timed_process, timed_step

    def take(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows


def thread_cpu() -> dict[int, tuple[str, float]]:
    """native thread id -> (name, CPU seconds) of this process's threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return found


def cpu_delta(before: dict, after: dict, roles: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    python_threads = {t.native_id: t.name for t in threading.enumerate()}
    for tid, (name, cpu) in after.items():
        role = roles.get(tid) or python_threads.get(tid, "OpenMP / native workers")
        role = "tokenizer pool" if "tokenizer" in role else role
        out[role] = out.get(role, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0.005}


def summarise_steps(rows: list[dict], batch: int) -> dict:
    """Totals, and the mean of the full-batch decode steps (batch sequences, one token each)."""
    decode = [r for r in rows if r.get("seqs") == batch and r.get("tokens") == batch]
    mean = lambda key, rs: statistics.mean(r[key] for r in rs) * 1e3 if rs else None  # noqa: E731
    return {"steps": len(rows), "step_s": round(sum(r["step"] for r in rows), 2),
            "execute_s": round(sum(r.get("execute", 0) for r in rows), 2),
            "process_s": round(sum(r.get("process", 0) for r in rows), 3),
            "engine_cpu_in_steps_s": round(sum(r["step_cpu"] for r in rows), 2),
            "full_decode_steps": len(decode), "full_decode_step_ms": mean("step", decode),
            "full_decode_execute_ms": mean("execute", decode), "full_decode_process_ms": mean("process", decode)}


# -- the runs --------------------------------------------------------------------------------------

def run_offline(llm, prompts, output_len, log: StepLog) -> dict:
    import kvpage
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    roles: dict[int, str] = {}
    result = []

    def work():
        roles[threading.get_native_id()] = "engine"
        result.append(llm.generate(prompts, params, use_tqdm=False))
        result.append(thread_cpu())  # before this thread (and its OpenMP team) exits

    thread = threading.Thread(target=work)
    before, start = thread_cpu(), time.perf_counter()
    thread.start()
    thread.join()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in result[0])
    return {"seconds": round(seconds, 2), "output_tok_s": round(tokens / seconds, 1),
            "cpu": cpu_delta(before, result[1], roles), **summarise_steps(log.take(), len(prompts))}


class InProcessServer:
    """build_app(llm) under uvicorn in a thread of this process, as `kvpage serve` runs it."""

    def __init__(self, llm) -> None:
        import socket

        import uvicorn

        from kvpage.server.app import build_app
        self.app = build_app(llm, served_model_name="bench")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self._serve, name="uvicorn")
        self.native_id = None
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def _serve(self) -> None:
        self.native_id = threading.get_native_id()
        self.server.run()

    def roles(self) -> dict[int, str]:
        loop = self.app.state.ctx.engine_loop
        return {self.native_id: "event loop", loop.client.thread.native_id: "engine"}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def run_served(server: InProcessServer, prompts, output_len, log: StepLog, prompts_path: Path,
               py_spy: str | None = None) -> dict:
    prompts_path.write_text(json.dumps(prompts))
    before, start = thread_cpu(), time.perf_counter()
    spy = None
    if py_spy:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--rate", "50",
                                "--format", "raw", "--output", py_spy, "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = subprocess.run([sys.executable, __file__, "--client", str(server.port), str(output_len), str(prompts_path)],
                          capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    if spy is not None:
        spy.send_signal(2)
        spy.wait()
    client = json.loads(done.stdout)
    tokens = sum(r["chunks"] for r in client["results"])  # one chunk per token unless the client fell behind
    ttfts = sorted(r["ttft"] for r in client["results"])
    return {"seconds": round(seconds, 2), "output_tok_s": round(output_len * len(prompts) / seconds, 1),
            "sse_chunks": tokens, "ttft_p50_s": round(ttfts[len(ttfts) // 2], 2),
            "cpu": {**cpu_delta(before, thread_cpu(), server.roles()), "client (subprocess)": round(client["cpu_s"], 2)},
            **summarise_steps(log.take(), len(prompts))}


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        return client_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny random model, 4 requests of 32 + 8 tokens")
    parser.add_argument("--py-spy", default=None, help="record the server runs with py-spy (raw format) here")
    parser.add_argument("--server-only", action="store_true")
    args = parser.parse_args()
    import tempfile

    from transformers import AutoTokenizer

    import kvpage
    from common import random_prompt
    from kvpage.model.loader import default_model_dir

    from common import write_json
    from serve_servers import tiny_model_dir

    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.rounds = 4, 32, 8, 1
    tmp = Path(tempfile.mkdtemp())
    model_dir = tiny_model_dir(tmp / "tiny") if args.quick else default_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    llm = kvpage.LLM(model=str(model_dir))
    log = StepLog(llm.llm_engine)
    server = InProcessServer(llm)
    path, results = tmp / "prompts.json", []
    try:
        warm = [random_prompt(tok, 32, 7_000 + i) for i in range(4)]
        run_offline(llm, warm, 4, log)
        run_served(server, warm, 4, log, path)
        for r in range(args.rounds):
            # Each run its own random prompts of the same lengths: none reads another's prefix cache.
            fresh = lambda k: [random_prompt(tok, args.input_len, (2 * r + k + 1) * 100_000 + i)  # noqa: E731
                               for i in range(args.num_prompts)]
            runs = [("offline", lambda: run_offline(llm, fresh(0), args.output_len, log)),
                    ("server", lambda: run_served(server, fresh(1), args.output_len, log, path, args.py_spy))]
            runs = runs[1:] if args.server_only else runs
            for name, run in (runs if r % 2 == 0 else runs[::-1]):
                results.append({"round": r, "run": name, "load1": os.getloadavg()[0], **run()})
                print(json.dumps(results[-1]), flush=True)
    finally:
        server.stop()
        llm.shutdown()
    write_json("serve_profile_quick" if args.quick else "serve_profile", {"workload": vars(args), "runs": results})


if __name__ == "__main__":
    main()
