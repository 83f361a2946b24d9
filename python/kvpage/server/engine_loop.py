"""EngineLoop: one thread owns the LLMEngine and steps it while requests exist; the HTTP handlers
reach it only through a thread-safe command queue, and get each request's RequestOutputs back on an
asyncio queue of their own event loop.

Only this thread calls add_request, step and abort_request, so the engine needs no locks. Commands
queued during a step are applied before the next one: new requests join the running batch there.

A step's outputs reach each event loop in one wake-up (one call_soon_threadsafe for the whole batch, not
one per request), and the engine's incremental detokenization runs here, in the step: the event loop only
frames and writes what it is handed. Should the thread die anyway (a BaseException out of a step), every
request in flight and every submission still queued is told (EngineDead), nothing waits forever, and
on_dead runs (`kvpage serve` exits, so that a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpage.server")


class QueueFull(Exception):
    """The waiting queue holds --max-waiting-requests requests already (HTTP 503)."""


class EngineStepError(Exception):
    """A step failed inside the engine; the request it reaches was withdrawn."""


class EngineDead(EngineStepError):
    """The engine loop is not running (it died, or the server is shutting down): HTTP 503."""


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: "_Sink"
    done: Future = field(default_factory=Future)


@dataclass
class _Sink:
    """Where a request's outputs go: an asyncio queue, filled from this thread via its loop."""
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


_STOP = object()


class EngineLoop:
    def __init__(self, engine, max_waiting_requests: int | None = None, on_dead=None) -> None:
        """on_dead(error): called on the loop thread if it dies (after every request was told)."""
        self.engine = engine
        self.on_dead = on_dead
        self.dead: EngineDead | None = None  # set once the thread died
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet taken into the engine
        self._engine_waiting = 0  # the scheduler's waiting queue, as of the last publish
        self.stats: dict = engine.stats()  # a snapshot, replaced (never mutated) after every step
        self.num_failed_steps = 0
        self._thread: threading.Thread | None = None

    # -- the handlers' side (event loop thread) -------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpage-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join()
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    async def add_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                          cache_salt: str | None, outputs: asyncio.Queue) -> None:
        """Queue a request; its RequestOutputs (or an EngineStepError) arrive on `outputs`. Raises
        QueueFull, or add_request's ValueError / TypeError for a request the engine refuses."""
        command = _Add(request_id, prompt, token_ids, params, cache_salt,
                       _Sink(asyncio.get_running_loop(), outputs))
        with self._lock:  # the dying thread sets `dead` under it, then fails what was queued before
            if not self.is_alive:
                raise self.dead or EngineDead("the engine loop is not running")
            limit = self.max_waiting_requests
            if limit is not None and self._queued + self._engine_waiting >= limit:
                raise QueueFull(f"the server's waiting queue is full ({limit} requests, --max-waiting-requests)")
            self._queued += 1
            self._commands.put(command)
        try:
            await asyncio.wrap_future(command.done)
        except asyncio.CancelledError:
            # Cancelled (a timeout around the handler, a client gone): the loop either skips the command
            # (not taken yet) or has added the request, which nobody would read; withdraw it either way.
            self.abort([request_id])
            raise

    def abort(self, request_ids) -> None:
        """Withdraw requests (a client went away): their blocks are freed before the next step."""
        self._commands.put(list(request_ids))

    # -- the loop (its own thread) --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: B036 (whatever ends the thread, nobody may wait forever)
            self._die(e)

    def _die(self, cause: BaseException) -> None:
        logger.critical("kvpage server: the engine loop died (%s: %s); every request in flight is failed",
                        type(cause).__name__, cause, exc_info=cause)
        error = EngineDead(f"the engine loop died ({type(cause).__name__}: {cause}); the server is restarting or"
                           " exiting")
        with self._lock:
            self.dead = error
        commands = self._take_commands(block=False)
        for c in commands:
            if isinstance(c, _Add) and c.done.set_running_or_notify_cancel():
                c.done.set_exception(error)
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.put(error)
        try:  # their blocks back, where the engine still can (an embedding application may go on with it)
            self.engine.abort_request(list(sinks))
            self._publish()
        except BaseException:  # noqa: B036
            logger.exception("kvpage server: withdrawing the requests of the dead engine loop failed")
        if self.on_dead is not None:
            self.on_dead(error)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            if any(c is _STOP for c in commands):
                self._close(commands)
                return
            try:
                self._apply(commands)
                if engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish()
            except Exception:
                # Nothing a client or an embedding application does may end this thread (/health would
                # turn 503 and every client in flight wait forever): a failure here is logged, and the
                # requests in flight are told and withdrawn so that the engine starts clean.
                logger.exception("kvpage server: the engine loop failed outside a step; its requests are aborted")
                try:
                    self._fail_all(EngineStepError("the engine loop failed; the request was aborted"))
                except Exception:
                    logger.exception("kvpage server: aborting the requests in flight failed too")

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list) -> None:
        added = 0
        try:
            for command in commands:
                if isinstance(command, _Add):
                    added += 1
                    self._add(command)
                else:
                    for rid in command:
                        self._sinks.pop(rid, None)
                    self.engine.abort_request(command)
        finally:
            if added:
                self._publish(taken=added)

    def _add(self, c: _Add) -> None:
        """Add one request and answer its submitter. A submission cancelled before this thread took it
        is skipped; once taken (set_running) it can no longer be cancelled, so the answer always lands."""
        if not c.done.set_running_or_notify_cancel():
            return
        try:
            self.engine.add_request(c.request_id, c.prompt, c.params, prompt_token_ids=c.token_ids, stream=True,
                                    cache_salt=c.cache_salt)
        except Exception as e:  # ValueError / TypeError: the client's; anything else reaches it as well
            c.done.set_exception(e)
            return
        self._sinks[c.request_id] = c.sink
        c.done.set_result(None)

    def _step(self) -> None:
        try:
            outputs: list[RequestOutput] = self.engine.step()
        except Exception as e:
            # The requests the failed step held are withdrawn and told (all in flight where the engine
            # cannot say which: a failure before the step was formed); the others go on.
            logger.exception("kvpage server: an engine step failed; its requests are aborted")
            self.num_failed_steps += 1
            self._fail(EngineStepError(f"the engine step failed: {type(e).__name__}: {e}"),
                       self.engine.failed_request_ids)
            return
        self._publish()  # before the outputs: a client that saw its request end sees it in /metrics too
        gone = self._hand_over(outputs)
        if gone:
            self._fail(EngineStepError("the request's event loop is closed"), gone)

    def _hand_over(self, outputs: list[RequestOutput]) -> list[str]:
        """The step's outputs to their event loops, one call_soon_threadsafe per loop; returns the
        unfinished requests whose loop is gone (closed by an embedding application)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
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

    def _close(self, commands: list) -> None:
        error = EngineDead("the server is shutting down")
        for c in commands:
            if isinstance(c, _Add) and c.done.set_running_or_notify_cancel():
                c.done.set_exception(error)
        self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        self._fail(error, None)

    def _fail(self, error: Exception, request_ids: list[str] | None) -> None:
        """Withdraw and tell the given requests (None: every one in flight)."""
        ids = list(self._sinks) if request_ids is None else [rid for rid in request_ids if rid in self._sinks]
        sinks = {rid: self._sinks.pop(rid) for rid in ids}
        self.engine.abort_request(ids)
        self._publish()
        for sink in sinks.values():
            sink.put(error)

    def _publish(self, taken: int = 0) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._queued -= taken
            self._engine_waiting = stats["num_waiting"]
            self.stats = stats
