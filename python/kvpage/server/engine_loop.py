"""EngineLoop: the server's side of the engine core. The handlers reach the engine only through it: it sends
requests and aborts to the engine core (kvpage.engine.core_client: a thread of this process, or a process of
its own) and hands each step's batch of RequestOutputs to the requests' asyncio queues.

A step's outputs reach each event loop in one wake-up (one call_soon_threadsafe for the whole batch, not
one per request); detokenization runs in the engine core, in the step: the event loop only frames and writes
what it is handed. Should the engine core die (a BaseException out of a step, a killed process), every
request in flight and every submission still unanswered is told (EngineDead), nothing waits forever, and
on_dead runs (`kvpage serve` exits, so that a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from kvpage.engine.core_client import EngineCoreClient, InprocEngineCoreClient
from kvpage.engine.core_process import AddRequest, EngineCoreOutputs
from kvpage.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpage.server")


class QueueFull(Exception):
    """The waiting queue holds --max-waiting-requests requests already (HTTP 503)."""


class EngineStepError(Exception):
    """A step failed inside the engine; the request it reaches was withdrawn."""


class EngineDead(EngineStepError):
    """The engine loop is not running (it died, or the server is shutting down): HTTP 503."""


@dataclass
class _Sink:
    """Where a request's outputs go: an asyncio queue, filled from the client's thread via its loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> bool:
        """False where the handler's event loop is gone (closed by an embedding application): nobody
        can read this request's outputs any more."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


def _deliver(items: list) -> None:
    """On the event loop: a step's outputs into their requests' queues, in one wake-up."""
    for q, item in items:
        q.put_nowait(item)


class EngineLoop:
    def __init__(self, client: EngineCoreClient, max_waiting_requests: int | None = None, on_dead=None) -> None:
        """client: the engine core (a kvpage.LLM is served by an in-process one). on_dead(error): called on
        the client's thread if the core dies (after every request was told)."""
        if not isinstance(client, EngineCoreClient):
            client = InprocEngineCoreClient(client)
        self.client = client
        self.on_dead = on_dead
        self.dead: EngineDead | None = None  # set once the core died
        self.max_waiting_requests = max_waiting_requests
        self._sinks: dict[str, _Sink] = {}
        self._adding: dict[str, Future] = {}  # sent, not yet answered by the core
        self._lock = threading.Lock()
        self._engine_waiting = 0  # the scheduler's waiting queue, as of the last batch
        self.stats: dict = client.info.stats  # a snapshot, replaced (never mutated) after every step
        self._started = False

    @property
    def engine(self):
        """The LLMEngine where the core runs in this process (None for a process core)."""
        return self.client.engine

    @property
    def num_failed_steps(self) -> int:
        return getattr(self.client, "num_failed_steps", 0)

    # -- the handlers' side (event loop thread) -------------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.client.start(self._on_outputs)

    def shutdown(self) -> None:
        if self._started:
            self._started = False
            self.client.shutdown()
            self._fail_everything(EngineDead("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._started and self.client.is_alive

    async def add_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                          cache_salt: str | None, outputs: asyncio.Queue) -> None:
        """Queue a request; its RequestOutputs (or an EngineStepError) arrive on `outputs`. Raises
        QueueFull, or add_request's ValueError / TypeError for a request the engine refuses."""
        done: Future = Future()
        done.set_running_or_notify_cancel()  # a cancelled handler cancels only its asyncio side: answers still land
        with self._lock:  # the dying client sets `dead` under it, then fails what was registered before
            if not self.is_alive:
                raise self.dead or EngineDead("the engine loop is not running")
            limit = self.max_waiting_requests
            if limit is not None and len(self._adding) + self._engine_waiting >= limit:
                raise QueueFull(f"the server's waiting queue is full ({limit} requests, --max-waiting-requests)")
            self._adding[request_id] = done
            self._sinks[request_id] = _Sink(asyncio.get_running_loop(), outputs)
        self.client.add_request(AddRequest(request_id, prompt, token_ids, params, cache_salt))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # Cancelled (a timeout around the handler, a client gone): the core has added the request or
            # will, and nobody would read it; withdraw it either way.
            self.abort([request_id])
            raise

    def abort(self, request_ids) -> None:
        """Withdraw requests (a client went away): their blocks are freed before the next step."""
        ids = list(request_ids)
        with self._lock:
            for rid in ids:
                self._sinks.pop(rid, None)
        self.client.abort_requests(ids)

    # -- the client's thread: one batch per step ------------------------------------------------

    def _on_outputs(self, batch: EngineCoreOutputs) -> None:
        with self._lock:
            if batch.stats is not None:
                self.stats = batch.stats
                self._engine_waiting = batch.stats["num_waiting"]
            answered = [(self._adding.pop(rid, None), None) for rid in batch.added]
            answered += [(self._adding.pop(rid, None), e) for rid, e in batch.refused.items()]
            for rid in batch.refused:
                self._sinks.pop(rid, None)
        for done, error in answered:
            if done is not None:
                done.set_exception(error) if error is not None else done.set_result(None)
        for message, request_ids in batch.failed:
            self._fail(EngineStepError(message), request_ids)
        gone = self._hand_over(batch.outputs)
        if gone:
            self._fail(EngineStepError("the request's event loop is closed"), gone)
            self.client.abort_requests(gone)
        if batch.dead is not None:
            self._die(EngineDead(batch.dead))

    def _hand_over(self, outputs) -> list[str]:
        """The step's outputs to their event loops, one call_soon_threadsafe per loop; returns the
        unfinished requests whose loop is gone (closed by an embedding application)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                batches.setdefault(sink.loop, []).append((sink.queue, out))
        gone = []
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                gone += [out.request_id for _, out in items if not out.finished]
        return gone

    def _die(self, error: EngineDead) -> None:
        with self._lock:
            self.dead = error
        self._fail_everything(error)
        if self.on_dead is not None:
            self.on_dead(error)

    def _fail_everything(self, error: EngineDead) -> None:
        """Every submission unanswered and every request in flight told (the core is gone or stopping)."""
        with self._lock:
            adding, self._adding = self._adding, {}
            sinks, self._sinks = self._sinks, {}
        for done in adding.values():
            if not done.done():
                done.set_exception(error)
        for sink in sinks.values():
            sink.put(error)

    def _fail(self, error: Exception, request_ids: list[str]) -> None:
        """Tell the given requests (the core withdrew them)."""
        with self._lock:
            sinks = [self._sinks.pop(rid) for rid in request_ids if rid in self._sinks]
        for sink in sinks:
            sink.put(error)
