"""Shared plumbing for the math-lab experiments: paths, threads, the ShareGPT-like workload, output.

Every experiment writes bench/results/mathlab/<name>.json and <name>.png ($OUT/mathlab/ if $OUT is set;
<name>_quick for a --quick smoke run) and prints a table.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/common.py
sys.path.insert(0, str(HERE.parent.parent / "python"))  # kvpage from the checkout

from common import add_model_argument, machine_info, print_table  # noqa: E402

RESULTS_DIR = Path(os.environ.get("OUT", HERE.parent / "results")) / "mathlab"

# ShareGPT-like lengths: lognormal, means matched to the ShareGPT statistics the vLLM paper reports
# (161 input, 338 output tokens on average); mean of lognormal(mu, s) is exp(mu + s^2 / 2).
PROMPT_MEAN, PROMPT_SIGMA = 161.0, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 338.0, 0.8
WORKLOAD_TEXT = (f"prompt ~ lognormal(mean {PROMPT_MEAN:g}, sigma {PROMPT_SIGMA}) and output ~ lognormal(mean"
                 f" {OUTPUT_MEAN:g}, sigma {OUTPUT_SIGMA}) tokens, each clipped to [4, max_len / 2]; seed 0")


@dataclass
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]

    def prompts(self, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
        """Random token ids: no two prompts share a block, so prefix hits come only from a
        recompute-preempted request finding its own blocks."""
        rng = random.Random(seed + 1)
        return [[rng.randrange(1, vocab) for _ in range(n)] for n in self.prompt_lens]


def sharegpt_like(num_requests: int, max_len: int = 2048, seed: int = 0, scale: float = 1.0) -> Workload:
    """scale < 1 shrinks both means (for real-engine runs on 2 shared cores)."""
    rng = random.Random(seed)
    cap = max_len // 2

    def draw(mean: float, sigma: float) -> int:
        mu = math.log(mean * scale) - sigma**2 / 2
        return min(cap, max(4, round(rng.lognormvariate(mu, sigma))))

    prompts, outputs = [], []
    for _ in range(num_requests):
        prompts.append(draw(PROMPT_MEAN, PROMPT_SIGMA))
        outputs.append(draw(OUTPUT_MEAN, OUTPUT_SIGMA))
    return Workload(prompts, outputs)


def add_smoke_arguments(parser, quick_help: str) -> None:
    """--quick (a smoke run: sizes cut down so the experiment finishes in seconds; its figures mean
    nothing) and --model (another model directory; the smoke tests pass a tiny random one)."""
    parser.add_argument("--quick", action="store_true", help=f"{quick_help} (smoke run)")
    add_model_argument(parser)


def output_name(name: str, quick: bool) -> str:
    """A smoke run's results never overwrite the real run's."""
    return f"{name}_quick" if quick else name


def set_threads(threads: int | None) -> int:
    """Torch threads for a timed run. The default is 1: on 2 cores shared with other jobs, a
    2-thread OpenMP region waits a scheduler quantum whenever the other core is busy (a swap_blocks
    call measured 12-16 ms at 2 threads vs 0.1 ms at 1), which would swamp what is being measured."""
    import torch

    torch.set_num_threads(threads or 1)
    return torch.get_num_threads()


def write_result(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"experiment": name, "machine": _machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=_json_default))
    print(f"wrote {path}")
    return path


def _machine() -> dict:
    try:
        info = machine_info()
    except Exception:  # torch missing: the bookkeeping-only experiments still run
        info = {}
    info["load_average"] = os.getloadavg()
    info["cpu_count"] = os.cpu_count()
    return info


def _json_default(o):
    if hasattr(o, "__dataclass_fields__"):
        return {k: getattr(o, k) for k in o.__dataclass_fields__}
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def figure(nrows: int = 1, ncols: int = 2, width: float = 12, height: float = 4.2):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width, height * nrows), squeeze=False)


def save_figure(fig, name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (as bench/scheduler_sim.py): p99 of 20 values is the largest."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def median(values) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2




def this_device(threads: int):
    """This machine as a costmodel.Device at `threads` torch threads (measured once per process)."""
    set_threads(threads)
    from kvpage.costmodel import measure_this_machine

    return measure_this_machine()


def random_ids(n: int, seed: int, vocab: int = 49152, low: int = 100) -> list[int]:
    """Token ids clear of the special tokens at the bottom of the vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


__all__ = ["HERE", "RESULTS_DIR", "WORKLOAD_TEXT", "Workload", "add_smoke_arguments", "figure", "median",
           "output_name", "percentile", "print_table", "random_ids", "save_figure", "set_threads", "sharegpt_like",
           "this_device", "write_result"]
