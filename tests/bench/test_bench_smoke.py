"""Every benchmark and example starts and finishes: each script's --quick smoke run, launched as a user
launches it (`python bench/X.py --quick` from the repository root, so the script's own directory is first
on sys.path, issue 38), on the tiny random model wherever the script takes --model. Peers that are not
installed (vLLM's venv, llama.cpp's build) are skipped by the scripts themselves, with a message.

The runs' figures mean nothing; what is checked is the exit status and that each wrote its results
(into a temporary $OUT, never bench/results/). They run two at a time, one torch thread each: on a
shared 2-core machine a 2-thread OpenMP region waits out a scheduler quantum whenever the other core
is busy, which made a smoke run's time depend on what else the machine ran.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = "{tiny}"  # the tiny model's directory, filled in at run time
TIMEOUT_S = 300
pytestmark = pytest.mark.smoke

# name -> (command line after `python`, what it writes under $OUT). Slowest first: two run at a time.
SCRIPTS = {
    "tp": (["bench/tp.py", "--quick", "--model", TINY], "tp_quick.json"),
    "dcp": (["bench/dcp.py", "--quick"], "dcp_quick.json"),
    "engine": (["bench/engine.py", "--quick", "--vllm", "--no-hf", "--model", TINY], "engine_quick.json"),
    "hf_dropin": (["bench/hf_dropin.py", "--quick", "--model", TINY], "hf_dropin_quick.json"),
    "kv_cache_dtype": (["bench/kv_cache_dtype.py", "--quick", "--model", TINY], "kv_cache_dtype_quick.json"),
    "llamacpp": (["bench/llamacpp.py", "--quick", "--model", TINY], "llamacpp_quick.json"),
    "full_prefix_hit": (["bench/full_prefix_hit.py", "--quick", "--model", TINY], "full_prefix_hit_quick.json"),
    "beam_search": (["bench/beam_search.py", "--quick", "--model", TINY], "beam_search_quick.json"),
    "profile_engine": (["bench/profile_engine.py", "--quick", "--model", TINY], None),
    "spec_decode": (["bench/spec_decode.py", "--quick", "--model", TINY], "spec_decode_quick.json"),
    "mathlab_chunked_prefill": (["bench/mathlab/chunked_prefill.py", "--quick", "--model", TINY],
                                "mathlab/chunked_prefill_quick.json"),
    "mathlab_copy_on_write": (["bench/mathlab/copy_on_write.py", "--quick", "--model", TINY],
                              "mathlab/copy_on_write_quick.json"),
    "mathlab_prefix_caching": (["bench/mathlab/prefix_caching.py", "--quick", "--model", TINY],
                               "mathlab/prefix_caching_quick.json"),
    "mathlab_swap_vs_recompute": (["bench/mathlab/swap_vs_recompute.py", "--quick", "--model", TINY],
                                  "mathlab/swap_vs_recompute_quick.json"),
    "mathlab_victim_policies": (["bench/mathlab/victim_policies.py", "--quick", "--model", TINY],
                                "mathlab/victim_policies_quick.json"),
    # run_all starts each experiment itself: one (no model) shows it passes --quick on and reads the result.
    "mathlab_run_all": (["bench/mathlab/run_all.py", "--quick", "--only", "fragmentation"],
                        "mathlab/fragmentation_quick.json"),
    # The examples show the default model itself: the only scripts here that load it.
    "example_hf_generate_paged": (["examples/hf_generate_paged.py", "--quick"], None),
    "example_paged_decode_loop": (["examples/paged_decode_loop.py", "--quick"], None),
    "engine_faults": (["bench/engine_faults.py", "--quick"], "engine_faults_quick.json"),
    "serve": (["bench/serve.py", "--quick"], "serve_quick.json"),
    "serve_profile": (["bench/serve_profile.py", "--quick"], "serve_profile_quick.json"),
    "kernels_cpu": (["bench/kernels_cpu.py", "--quick"], "kernels_quick.json"),
    "linear": (["bench/linear.py", "--quick"], "linear_quick.json"),
    "scheduler_sim": (["bench/scheduler_sim.py", "--quick"], "scheduler_sim_quick.json"),
    "attention_isa": (["bench/attention_isa.py", "--quick"], None),  # says so and exits 0 without AVX-512
    "prefill_history": (["bench/prefill_history.py", "--quick"], None),
    "block_manager": (["bench/block_manager.py", "--quick"], "block_manager_quick.json"),
    "hybrid_kv": (["bench/hybrid_kv.py", "--quick"], "hybrid_kv_quick.json"),
    "families": (["bench/families.py", "--quick"], "families.json"),
    "serve_attack": (["bench/serve_attack.py", "--quick"], "serve_attack_quick.json"),
    "multiturn": (["bench/multiturn.py", "--quick"], "multiturn_quick.json"),
    # GPU only (bench/gpu_check.sh runs it there): here it must at least start.
    "kernels_cuda_help": (["bench/kernels_cuda.py", "--help"], None),
    # GPU rows; without CUDA --quick runs the same code on the CPU with tiny models.
    "engine_cuda": (["bench/engine_cuda.py", "--quick"], "engine_cuda_quick.json"),
}
# Modules the scripts import, not scripts; and vLLM's side, which runs in vLLM's own venv.
NOT_SCRIPTS = {"bench/common.py", "bench/mathlab/_common.py", "bench/peers/vllm_peer.py",
               "bench/peers/vllm_launcher.py", "bench/peers/llamacpp_launcher.py", "bench/serve_servers.py"}


def scratch_dir(out: Path, argv: list[str]) -> Path:
    """The script's own TMPDIR: what it leaves there is checked after the run."""
    return out / f"tmp-{Path(argv[0]).stem}"


def run_script(argv: list[str], model_dir: Path, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    tmp = scratch_dir(out, argv)
    tmp.mkdir()
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "TMPDIR": str(tmp)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *(a.replace(TINY, str(model_dir)) for a in argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def smoke_runs(request, tiny_model_dir, tmp_path_factory):
    """The selected scripts' runs, all submitted at once (two run at a time), each awaited by its test."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    out = tmp_path_factory.mktemp("bench-out")
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(run_script, argv, tiny_model_dir, out)
               for name, (argv, _) in SCRIPTS.items() if name in selected}
    yield futures, out
    pool.shutdown(cancel_futures=True)


def test_every_script_has_a_smoke_run():
    scripts = {str(p.relative_to(ROOT)) for d in ("bench", "bench/mathlab", "bench/peers", "examples")
               for p in (ROOT / d).glob("*.py")}
    covered = {argv[0] for argv, _ in SCRIPTS.values()} | {f"bench/mathlab/{n}.py" for n in ("fragmentation",)}
    assert scripts - NOT_SCRIPTS == covered, "a script without a smoke run here (or a stale entry)"


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_quick_run(name, smoke_runs):
    futures, out = smoke_runs
    proc, seconds = futures[name].result()
    argv, writes = SCRIPTS[name]
    assert proc.returncode == 0, f"python {' '.join(argv)} exited {proc.returncode} after {seconds:.0f} s:\n" \
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    if writes:
        assert (out / writes).is_file(), f"python {' '.join(argv)} wrote no {writes}"
    # A KV tier's block files are ~0.5 GB a full run: a benchmark removes its tiers' directories.
    left = sorted(str(p) for p in scratch_dir(out, argv).rglob("*.kvb"))
    assert not left, f"python {' '.join(argv)} left KV tier files behind: {left[:3]}"
