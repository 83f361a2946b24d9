"""Shared benchmark plumbing: timing, memory bandwidth, JSON + PNG output."""
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))


def median_time(fn, iters=10, warmup=2, min_seconds=0.0):
    """Median wall time of fn() in seconds, after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < iters or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs since boot, from /proc/stat; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_idle(max_seconds: float = 15.0, busy_below: float = 0.1, sample: float = 0.25) -> float:
    """Waits until the machine's CPUs are less than busy_below busy over a `sample`-second window (at most
    max_seconds); returns the seconds waited. Before each timed run of a paired benchmark: a peer that
    returns its result may keep spinning (vLLM's CPU worker busy-polls a core for ~1.5 s after a run),
    which would take a core from the next system's run."""
    start = time.perf_counter()
    before = _cpu_times()
    if before is None:
        return 0.0
    while time.perf_counter() - start < max_seconds:
        time.sleep(sample)
        after = _cpu_times()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < busy_below:
            break
        before = after
    return time.perf_counter() - start


def read_bandwidth_gbs(num_bytes=1 << 30, iters=5):
    """This machine's memory read bandwidth, as torch's multithreaded sum over a buffer far larger
    than the caches achieves it."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / median_time(lambda: x.sum(), iters=iters) / 1e9


# A smoke run's engines (--quick): a KV pool its few short requests fit in many times over, and no swap
# pool, so starting one does not first zero the default 1 GiB + 0.5 GiB.
QUICK_ENGINE_ARGS = {"num_kv_blocks": 256, "swap_space_gib": 0}


def add_model_argument(parser) -> None:
    """--model: the benchmarks run the embedded default model unless given another local HF directory
    (the smoke tests pass a tiny random model with the default model's tokenizer, so each starts in seconds)."""
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="a local HF model directory (default: the embedded SmolLM2-135M-Instruct)")


def model_dir(model: str | None) -> Path:
    """The directory --model names, or the embedded default model's (converted on first use)."""
    if model:
        return Path(model)
    from kvpage.model.loader import default_model_dir
    return default_model_dir()


def cpu_model() -> str:
    """The CPU's model name as lscpu shows it (figures name the CPU they ran on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info():
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def write_json(name, payload):
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows, columns):
    """Rows are dicts; a column a row lacks prints as '-'."""
    cells = [[f"{r.get(c, '-')}" for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def random_prompt(tokenizer, length: int, seed: int) -> list[int]:
    """length ordinary token ids (no special tokens), as llama-batched-bench's random prompt."""
    special = set(tokenizer.all_special_ids)
    rng = random.Random(seed)
    ids = []
    while len(ids) < length:
        t = rng.randrange(len(tokenizer))
        if t not in special:
            ids.append(t)
    return ids


def hf_continuous_batching_config(prompt_lens, output_lens):
    """transformers' ContinuousBatchingConfig with a KV cache sized for the workload (every request's prompt and
    output, a spare page each), as kvpage's is: left to itself HF's manager takes 80-90% of the free memory, which
    on a CPU run beside other work gets it OOM-killed."""
    from transformers.generation import ContinuousBatchingConfig

    page_size = ContinuousBatchingConfig().page_size
    num_blocks = sum(-(-(p + n) // page_size) + 1 for p, n in zip(prompt_lens, output_lens))
    return ContinuousBatchingConfig(num_blocks=num_blocks)
