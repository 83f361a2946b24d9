"""The engine core's client: the one face through which the server reaches an engine core (vLLM's
EngineCoreClient). Two implementations:

- InprocEngineCoreClient: the EngineCore loop on a thread of this process, over an existing kvpage.LLM
  (build_app(llm), embedding applications, tests that patch the runner). Batches are handed over directly.
- MPEngineCoreClient: the engine core in a process of its own (multiprocessing spawn), built there from the
  serve options; commands and batches cross two one-way pipes as small pickles. The server's process then only
  speaks HTTP. A core that dies, even by SIGKILL, is seen as the pipe's EOF: its last word (or the exit code)
  reaches on_outputs as a dead batch, so that nothing waits forever.

Both call on_outputs(EngineCoreOutputs) on a thread of their own, once per step. Offline, kvpage.LLM steps its
engine in-process and synchronously: the same LLMEngine the in-process core owns.
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from abc import ABC, abstractmethod

from .core_process import AbortRequests, AddRequest, EngineCore, EngineCoreInfo, EngineCoreOutputs, Stop, \
    decode_outputs, run_engine_core

logger = logging.getLogger("kvpage.engine_core")

ENGINE_CORE_MODES = ("process", "inprocess")


class EngineCoreClient(ABC):
    info: EngineCoreInfo
    engine = None  # the LLMEngine where it lives in this process (in-process core), else None

    @abstractmethod
    def start(self, on_outputs) -> None:
        """Begin serving; on_outputs(EngineCoreOutputs) is called on a thread of the client's, one batch at a
        time, the last one with dead set if the core ends other than by shutdown()."""

    @abstractmethod
    def add_request(self, request: AddRequest) -> None:
        """Queue a request (never waits for a step); its acceptance comes in a batch's added / refused."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Withdraw requests: their blocks are freed before the core's next step."""

    @abstractmethod
    def shutdown(self) -> None:
        """Withdraw what is in flight and stop the core (the caller tells the requests); returns once it
        stopped."""

    @property
    @abstractmethod
    def is_alive(self) -> bool:
        ...


class InprocEngineCoreClient(EngineCoreClient):
    """The engine core on a thread of this process, over llm's engine (which nobody else may step meanwhile)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.info = EngineCoreInfo.of(llm)
        self.core: EngineCore | None = None
        self._inbox: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None  # the core's, while it runs

    def start(self, on_outputs) -> None:
        if self.thread is None:
            self.core = EngineCore(self.engine, on_outputs)
            self.thread = threading.Thread(target=self._run, name="kvpage-engine-core", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.core.run(self._inbox)
        except BaseException:  # noqa: B036 (logged, and its last batch told the client)
            pass

    def add_request(self, request: AddRequest) -> None:
        self._inbox.put(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inbox.put(AbortRequests(list(request_ids)))

    def shutdown(self) -> None:
        if self.thread is not None:
            self._inbox.put(Stop())
            self.thread.join()
            self.thread = None

    @property
    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def num_failed_steps(self) -> int:
        return self.core.num_failed_steps if self.core is not None else 0


class MPEngineCoreClient(EngineCoreClient):
    """The engine core in a spawned process, built there as kvpage.LLM(model=model, **options). The
    constructor returns once the core is ready (model loaded, KV cache allocated), or raises RuntimeError
    with the reason it did not start."""

    def __init__(self, model, options: dict, start_timeout: float | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding OpenMP / torch threads
        commands_out, commands_in = ctx.Pipe(duplex=False)  # (read end, write end)
        batches_out, batches_in = ctx.Pipe(duplex=False)
        # Not a daemon: the core starts tensor-parallel workers of its own. It stops when its input pipe
        # closes, so a server that dies (even by SIGKILL) leaves no core behind.
        self.process = ctx.Process(target=run_engine_core, args=(model, options, commands_out, batches_in),
                                   name="kvpage-engine-core")
        self.process.start()
        commands_out.close()  # the child's ends: EOF on ours once the child is gone
        batches_in.close()
        self._send_end, self._recv_end = commands_in, batches_out
        self._send_lock = threading.Lock()  # handlers of several event loops may send at once
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._ended = False
        self._prompt_ids: dict[str, list[int] | None] = {}  # decode_outputs' record of the requests in flight
        self._prompts_lock = threading.Lock()
        self.info = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float | None) -> EngineCoreInfo:
        try:
            if timeout is not None and not self._recv_end.poll(timeout):
                raise RuntimeError(f"the engine core did not start within {timeout} s")
            answer = self._recv_end.recv()
        except (EOFError, OSError):
            answer = RuntimeError(f"the engine core process exited while starting ({self._exit()})")
        except BaseException:
            self._kill()
            raise
        if isinstance(answer, BaseException):
            self._kill()
            raise answer
        return answer

    def start(self, on_outputs) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, args=(on_outputs,), name="kvpage-core-client",
                                            daemon=True)
            self._reader.start()

    def _read(self, on_outputs) -> None:
        """Batches to on_outputs until the core ends; an end without a dead batch (SIGKILL, an OOM kill, a
        crash in native code) gets one, naming the exit code."""
        told = False
        while not told:
            try:
                batch = self._recv_end.recv()
            except (EOFError, OSError):
                break
            with self._prompts_lock:
                self._forget(batch.refused)
                for _, request_ids in batch.failed:
                    self._forget(request_ids)
                batch.outputs = decode_outputs(batch.outputs, self._prompt_ids)
            on_outputs(batch)
            told = batch.dead is not None
        self._ended = True
        if not told and not self._stopping:
            message = f"the engine core process exited ({self._exit()}); the server is restarting or exiting"
            logger.critical("kvpage server: %s", message)
            on_outputs(EngineCoreOutputs(dead=message))

    def _exit(self) -> str:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _send(self, command) -> None:
        with self._send_lock:
            try:
                self._send_end.send(command)
            except (BrokenPipeError, OSError):
                pass  # the core is gone: the reader reports it (dead) to everything in flight

    def add_request(self, request: AddRequest) -> None:
        with self._prompts_lock:
            self._prompt_ids[request.request_id] = None  # before it is sent: its first output may come at once
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(list(request_ids)))
        with self._prompts_lock:
            self._forget(request_ids)

    def _forget(self, request_ids) -> None:
        for rid in request_ids:
            self._prompt_ids.pop(rid, None)

    def shutdown(self) -> None:
        self._stopping = True
        if self.process.is_alive():
            self._send(Stop())
        self.process.join(timeout=60)
        if self.process.is_alive():
            logger.warning("kvpage server: the engine core did not stop in 60 s; killing it")
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout=10)
        self._send_end.close()

    def _kill(self) -> None:
        self.process.kill()
        self.process.join()

    @property
    def is_alive(self) -> bool:
        return not self._ended and self.process.is_alive()


def make_engine_core_client(mode: str, model, options: dict) -> EngineCoreClient:
    """`kvpage serve --engine-core MODE`: the process core (built in its process), or the in-process one."""
    if mode == "process":
        return MPEngineCoreClient(model, options)
    if mode == "inprocess":
        import kvpage
        return InprocEngineCoreClient(kvpage.LLM(model=model, **options))
    raise ValueError(f"engine_core must be one of {ENGINE_CORE_MODES}, got {mode!r}")
