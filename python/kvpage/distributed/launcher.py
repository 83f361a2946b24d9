"""Starting, watching and stopping worker processes on this machine (tensor_parallel_size=N without torchrun).

Workers are fresh interpreters (`python -m kvpage.distributed`), not multiprocessing children: nothing of
the caller's __main__ is re-imported, so a script without an `if __name__ == "__main__":` guard, a notebook
or `python -c` all work. A model given as an object reaches them through a temporary save_pretrained
directory (on /dev/shm where there is one); a directory or the default model they load themselves.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class WorkerSpec:
    """Everything a worker needs, passed as one JSON argument."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    store_prefix: str
    model: str | None  # a HF model directory, or None for the embedded default model
    dtype: str  # torch dtype name, "float32"
    device_type: str  # "cpu" or "cuda" (rank r uses cuda:r)
    num_threads: int  # torch intra-op threads
    parent_pid: int
    startup_timeout_s: float
    dcp_size: int = 1  # decode_context_parallel_size


def threads_per_rank(world_size: int) -> int:
    """The cores this process may use, shared out: N ranks each running all cores' worth of OpenMP threads
    would oversubscribe the machine N-fold (and their spinning barriers make that far worse than N x)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def model_source(model_arg, loaded_model) -> tuple[str | None, str | None]:
    """(what workers load, a temporary directory to delete once they have): a path or None as given; a
    model object saved with save_pretrained."""
    if model_arg is None or isinstance(model_arg, (str, os.PathLike)):
        return (None if model_arg is None else os.fspath(model_arg)), None
    parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    tmp = tempfile.mkdtemp(prefix="kvpage-tp-model-", dir=parent)
    try:
        with quiet_transformers():
            loaded_model.save_pretrained(tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"tensor_parallel_size > 1 with a model object needs model.save_pretrained to work, so the"
                         f" worker processes can load it: {e}") from e
    return tmp, tmp


@contextmanager
def quiet_transformers():
    """No progress bar for a save or load the user did not ask for."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class WorkerProcesses:
    """The N-1 local worker processes (ranks 1..N-1)."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(specs[0].num_threads) if specs else env.get("OMP_NUM_THREADS", "1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a worker must not mistake itself for a torchrun rank
            env.pop(key, None)
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for spec in specs:
                self.procs[spec.rank] = subprocess.Popen(
                    [sys.executable, "-m", "kvpage.distributed", json.dumps(asdict(spec))], env=env)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def dead(self) -> str | None:
        """A description of the first worker that has exited, or None if all live."""
        for rank, p in self.procs.items():
            if p.poll() is not None:
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) died ({_signal_name(p.returncode)})"
        return None

    def wait_dead(self, grace_s: float) -> str | None:
        """dead(), allowing a dying worker `grace_s` to finish dying (a broken collective is often seen
        before the worker's exit is)."""
        deadline = time.monotonic() + grace_s
        while True:
            found = self.dead()
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.02)

    def wait_ready(self, store, timeout_s: float) -> None:
        """Block until every worker has set ready/<rank> in the store (model loaded and sharded); a worker
        that dies or reports failed/<rank> first raises at once, a slow one after timeout_s."""
        pending = set(self.procs)
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank in sorted(pending):
                if store.check([f"failed/{rank}"]):
                    raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n"
                                       f"{store.get(f'failed/{rank}').decode(errors='replace')}")
                if store.check([f"ready/{rank}"]):
                    pending.discard(rank)
            if not pending:
                return
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{dead} while loading the model (see its output above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(pending)} did not load the model within"
                                   f" {timeout_s:.0f} s (KVPAGE_TP_STARTUP_TIMEOUT_S)")
            time.sleep(0.05)

    def stop(self, grace_s: float) -> None:
        """Wait up to grace_s for the workers to exit (after a shutdown message), then kill the rest."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        for p in self.procs.values():
            p.wait()


def watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """In a worker: exit when the driver process is gone (killed before it could shut us down), so no
    worker outlives it. A daemon thread; os._exit because the main thread is blocked in a collective."""
    def run():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=run, name="kvpage-parent-watch", daemon=True).start()
