"""A worker that dies or hangs, or a driver that dies: a clear error in bounded time, no orphan processes,
and the process can build a working LLM afterwards. Also the torchrun launch (rank 0 drives, rank 1 serves)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvpage
from kvpage import SamplingParams

from tp_helpers import assert_same_greedy, is_gone, random_prompts, tiny_llama

HERE = Path(__file__).resolve().parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def signal_worker_at_step(llm: kvpage.LLM, sig: int, step: int) -> list[int]:
    """Send sig to rank 1 just before the driver's step number `step` (mid-generation); returns the step
    counter, so a test can see where the error surfaced."""
    pid, real, steps = llm.runner.worker_pids[1], llm.runner.execute, []

    def execute(batch):
        steps.append(len(steps) + 1)
        if len(steps) == step:
            os.kill(pid, sig)
        return real(batch)

    llm.runner.execute = execute  # the engine calls runner.execute: the instance attribute wins
    return steps


def test_a_killed_worker_is_a_clear_error_and_a_new_llm_works(model):
    prompts = random_prompts([20, 40, 33], seed=6)
    llm = kvpage.LLM(model=model, num_kv_blocks=64, tensor_parallel_size=2)
    pid = llm.runner.worker_pids[1]
    steps = signal_worker_at_step(llm, signal.SIGKILL, step=3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
        llm.generate(prompts, LONG, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert steps == [1, 2, 3]  # the step that met the dead worker raised
    assert is_gone(pid)
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()  # after a failure too: nothing left to release, no error

    again = kvpage.LLM(model=model, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        want = kvpage.LLM(model=model, num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
        assert_same_greedy(model, prompts, want, again.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        again.shutdown()
    assert all(is_gone(p) for p in again.runner.worker_pids.values())
    with pytest.raises(RuntimeError, match="shut down"):
        again.generate(prompts, GREEDY, use_tqdm=False)


def test_a_hung_worker_times_out_and_is_killed(model, monkeypatch):
    monkeypatch.setenv("KVPAGE_TP_TIMEOUT_S", "3")
    llm = kvpage.LLM(model=model, num_kv_blocks=64, tensor_parallel_size=2)
    pid = llm.runner.worker_pids[1]
    signal_worker_at_step(llm, signal.SIGSTOP, step=2)  # alive, holding its sockets open, never answering
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="did not answer within 3 s"):
            llm.generate(random_prompts([30, 10], seed=7), LONG, use_tqdm=False)
        assert time.monotonic() - start < 20
        assert is_gone(pid)  # killed, though stopped
    finally:
        if not is_gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_workers_exit_when_the_driver_is_killed():
    script = (f"import json, os, signal, sys; sys.path.insert(0, {str(HERE)!r})\n"
              "from tp_helpers import tiny_llama\nimport kvpage\n"
              "llm = kvpage.LLM(model=tiny_llama(), num_kv_blocks=16, tensor_parallel_size=2)\n"
              "print(json.dumps(list(llm.runner.worker_pids.values())), flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    driver = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert driver.returncode == -signal.SIGKILL, driver.stderr
    pids = json.loads(driver.stdout.strip().splitlines()[-1])
    assert len(pids) == 1
    deadline = time.monotonic() + 15
    while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(is_gone(p) for p in pids), "a worker outlived its driver"


def test_torchrun_rank0_drives_rank1_serves(model):
    """`torchrun --nproc-per-node 2 script.py` with kvpage.LLM(tensor_parallel_size=2) in the script."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "torchrun_script.py")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, run.stdout  # only rank 0 returns from kvpage.LLM(...)
    from torchrun_script import PROMPT_LENGTHS, SEED, params

    reference = tiny_llama(seed=SEED)
    prompts = random_prompts(PROMPT_LENGTHS)
    want = kvpage.LLM(model=reference, num_kv_blocks=64).generate(prompts, params(), use_tqdm=False)
    got = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in json.loads(lines[0][len("TOKENS "):])]
    assert_same_greedy(reference, prompts, want, got)
