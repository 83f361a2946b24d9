"""bench/prefill_history.py --threads N: each paired child process runs the op on N torch threads (its
OMP_NUM_THREADS and its own --threads), one thread is timed by its CPU time and several by the wall clock
(CPU time would add the threads' times together), and a value below 1 is refused naming the flag. No
child starts: the launcher is replaced by one that records its command lines."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import prefill_history  # noqa: E402


@pytest.mark.parametrize("threads", [1, 2])
def test_children_run_on_the_asked_threads(monkeypatch, threads):
    launched = []

    def fake_run(cmd, env, **kwargs):
        launched.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0, stdout="0.001\n", stderr="")

    monkeypatch.setattr(prefill_history.subprocess, "run", fake_run)
    monkeypatch.setattr(prefill_history, "beside_gemms", lambda args, seconds: "")  # no GEMMs timed here
    prefill_history.main(["--against", "/nonexistent", "--rounds", "2", "--threads", str(threads)])
    assert len(launched) == 4  # two builds, two rounds
    for cmd, env in launched:
        assert env["OMP_NUM_THREADS"] == str(threads)
        assert f"--threads={threads}" in cmd and "--child" in cmd


def test_clock_is_cpu_time_for_one_thread_wall_for_several():
    assert prefill_history.clock(1) is time.process_time
    assert prefill_history.clock(2) is time.perf_counter


def test_threads_below_one_refused(capsys):
    with pytest.raises(SystemExit):
        prefill_history.main(["--threads", "0"])
    assert "--threads" in capsys.readouterr().err
