"""Runs llama.cpp's own batched benchmark (llama-batched-bench) on the default model in F32 (or BF16).

llama.cpp stays out of kvpage's dependencies and out of CI: bench/peers/setup_llamacpp.sh builds it under
$KVPAGE_LLAMACPP_DIR (default ~/.cache/kvpage/llama.cpp) and writes F32 and BF16 copies of the model there; this
module only starts the tool and reads its JSONL rows.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROW_PREFIX = '{"n_kv_max"'  # how llama-batched-bench --output-format jsonl starts each result row


def llamacpp_dir() -> Path:
    return Path(os.environ.get("KVPAGE_LLAMACPP_DIR", Path.home() / ".cache" / "kvpage" / "llama.cpp"))


def batched_bench() -> Path:
    return llamacpp_dir() / "bin" / "llama-batched-bench"


def model_file(weight_type: str = "F32") -> Path | None:
    """The default model's GGUF in weight_type (F32 or BF16), as setup_llamacpp.sh writes it."""
    models = sorted(llamacpp_dir().glob(f"*.{weight_type}.gguf"))
    return models[0] if models else None


def available(weight_type: str = "F32") -> bool:
    return batched_bench().is_file() and model_file(weight_type) is not None


def run_batched_bench(pp: int, tg: int, npls: list[int], threads: int, kv_unified: bool,
                      timeout_s: float = 1800, weight_type: str = "F32") -> list[dict]:
    """One llama-batched-bench process: for each npl, npl sequences share one pp-token prompt (-pps:
    computed once, then copied to every sequence's cells; or, kv_unified, held once in one buffer all
    sequences attend over: -kvu) and then decode tg tokens together; flash attention on. Returns its
    rows (t_pp, t_tg, t in seconds; speed_* in tokens/s), one per npl."""
    if not available(weight_type):
        raise RuntimeError(f"no llama.cpp peer ({weight_type} model) under {llamacpp_dir()}:"
                           f" run bash bench/peers/setup_llamacpp.sh")
    cmd = [str(batched_bench()), "-m", str(model_file(weight_type)), "-c", str(max(npls) * (pp + tg) + 16), "-b", "2048",
           "-ub", "512", "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, npls)), "-pps",
           "-kvu" if kv_unified else "-no-kvu", "-fa", "on", "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    rows = [json.loads(line[line.index(ROW_PREFIX):]) for line in lines if ROW_PREFIX in line]
    if proc.returncode != 0 or len(rows) != len(npls):
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"llama-batched-bench exited {proc.returncode} with {len(rows)} of {len(npls)} rows:\n{tail}")
    return rows
