"""The engine core: the one loop that owns an LLMEngine (its scheduler, runner and detokenizer). It takes
requests and aborts from an inbox, steps while any request is unfinished, and hands each step's outputs to
its client in one batch, with the engine's stats (vLLM's EngineCore / EngineCoreProc).

It runs either on a thread of the server's process (core_client.InprocEngineCoreClient) or as the main loop of
a process of its own (run_engine_core, started by core_client.MPEngineCoreClient): then the server's process
only speaks HTTP, and its event loop, JSON and SSE framing never compete with a step for the GIL. The engine
core is the tensor-parallel driver too: its LLM starts the TP workers from this process.

Integrity: a step that raises fails only the requests it held (EngineCoreOutputs.failed); a BaseException
out of the loop ends the core, and its last batch says so (dead), after every request in flight was
withdrawn where the engine still can. Idle, the loop blocks on its inbox: no polling.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
from dataclasses import dataclass, field, fields

from kvpage.engine.outputs import CompletionOutput, RequestOutput
from kvpage.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpage.engine_core")


@dataclass
class AddRequest:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


class Stop:
    """Inbox command: withdraw what is in flight and end the loop (the client tells the requests)."""


@dataclass
class EngineCoreOutputs:
    """One step's batch (or the answer to commands taken while idle). added / refused answer the
    AddRequests taken since the last batch, before this batch's outputs; failed: (message, request ids)
    of a failed step; dead: why the core ended (its last batch), after failing every request in flight."""
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: dict | None = None
    added: list[str] = field(default_factory=list)
    refused: dict[str, Exception] = field(default_factory=dict)
    failed: list[tuple[str, list[str]]] = field(default_factory=list)
    dead: str | None = None


@dataclass
class EngineCoreInfo:
    """What the server needs of the engine without stepping it: sent once, when the core is ready.
    scheduler: for its check_fits only (constants of the configuration: safe on a copy, in another process)."""
    max_model_len: int | None
    vocab_size: int | None
    sampling_defaults: dict
    tokenizer: object
    scheduler: object
    stats: dict

    @classmethod
    def of(cls, llm) -> "EngineCoreInfo":
        engine = llm.llm_engine
        return cls(engine.config.max_model_len, getattr(engine.runner, "vocab_size", None),
                   llm.default_sampling_fields, llm.tokenizer, engine.scheduler, engine.stats())


class EngineCore:
    """The loop over one engine. send(EngineCoreOutputs) is called on the loop's thread, once per step."""

    def __init__(self, engine, send) -> None:
        self.engine = engine
        self.send = send
        self.num_failed_steps = 0

    def run(self, inbox: queue.Queue) -> None:
        """Serve the inbox until Stop (then fail what is in flight) or a BaseException (then die: the last
        batch says why, and the exception propagates)."""
        try:
            self._serve(inbox)
        except BaseException as e:  # noqa: B036 (whatever ends the loop, nobody may wait forever)
            self._die(e)
            raise

    def _serve(self, inbox: queue.Queue) -> None:
        engine = self.engine
        while True:
            commands = _take(inbox, block=not engine.has_unfinished_requests())
            batch = EngineCoreOutputs()
            stop = any(isinstance(c, Stop) for c in commands)
            try:
                self._apply(commands, batch)
                if stop:  # their blocks back; the client tells their requests (503: shutting down)
                    self.engine.abort_request(self._in_flight())
                elif engine.has_unfinished_requests():
                    self._step(batch)
            except Exception as e:
                # Nothing a client does may end the core: the requests in flight are told and withdrawn so
                # that the engine starts clean.
                logger.exception("kvpage engine core: the loop failed outside a step; its requests are aborted")
                self._fail(batch, f"the engine loop failed ({type(e).__name__}: {e}); the request was aborted",
                           None)
            batch.stats = engine.stats()
            self.send(batch)
            if stop:
                return

    def _apply(self, commands: list, batch: EngineCoreOutputs) -> None:
        # A request withdrawn before the core took it (its client gone at once) never enters the engine:
        # added then aborted in one go would leave it unfinished between the two.
        withdrawn = {rid for c in commands if isinstance(c, AbortRequests) for rid in c.request_ids}
        for c in commands:
            if isinstance(c, AddRequest) and c.request_id in withdrawn:
                batch.added.append(c.request_id)  # answered all the same: nobody waits on it any more
            elif isinstance(c, AddRequest):
                try:
                    self.engine.add_request(c.request_id, c.prompt, c.params, prompt_token_ids=c.token_ids,
                                            stream=True, cache_salt=c.cache_salt)
                except Exception as e:  # ValueError / TypeError: the client's; anything else reaches it too
                    batch.refused[c.request_id] = e
                else:
                    batch.added.append(c.request_id)
            elif isinstance(c, AbortRequests):
                self.engine.abort_request(c.request_ids)

    def _step(self, batch: EngineCoreOutputs) -> None:
        try:
            batch.outputs = self.engine.step()
        except Exception as e:
            # The requests the failed step held are withdrawn and told (all in flight where the engine
            # cannot say which: a failure before the step was formed); the others go on.
            logger.exception("kvpage engine core: an engine step failed; its requests are aborted")
            self.num_failed_steps += 1
            self._fail(batch, f"the engine step failed: {type(e).__name__}: {e}", self.engine.failed_request_ids)

    def _fail(self, batch: EngineCoreOutputs, message: str, request_ids: list[str] | None) -> None:
        """Withdraw the given requests (None: every one in flight) and say so in the batch."""
        ids = self._in_flight() if request_ids is None else list(request_ids)
        try:
            self.engine.abort_request(ids)
        finally:
            batch.failed.append((message, ids))

    def _in_flight(self) -> list[str]:
        return list(self.engine.scheduler.requests)

    def _die(self, cause: BaseException) -> None:
        logger.critical("kvpage engine core: the engine loop died (%s: %s); every request in flight is failed",
                        type(cause).__name__, cause, exc_info=cause)
        batch = EngineCoreOutputs(dead=f"the engine loop died ({type(cause).__name__}: {cause}); the server is"
                                       " restarting or exiting")
        try:  # their blocks back, where the engine still can (an embedding application may go on with it)
            self.engine.abort_request(self._in_flight())
            batch.stats = self.engine.stats()
        except BaseException:  # noqa: B036
            logger.exception("kvpage engine core: withdrawing the requests of the dead engine loop failed")
        self.send(batch)


def _take(inbox: queue.Queue, block: bool) -> list:
    """Every command queued by now; with block, wait for the first (an idle core sleeps here)."""
    commands = [inbox.get()] if block else []
    while True:
        try:
            commands.append(inbox.get_nowait())
        except queue.Empty:
            return commands


# -- the wire: a step's outputs as tuples ------------------------------------------------------------

_REQUEST_FIELDS = tuple(f.name for f in fields(RequestOutput))
_COMPLETION_FIELDS = tuple(f.name for f in fields(CompletionOutput))
_OUTPUTS = _REQUEST_FIELDS.index("outputs")
_PROMPT_IDS = _REQUEST_FIELDS.index("prompt_token_ids")


def encode_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """RequestOutputs as tuples of builtins for the pipe: they pickle several times faster than dataclasses,
    and a step of hundreds of requests is pickled, sent and unpickled every step. The prompt's token ids go
    only with a request's first output (one token per sample) and its final one; decode_outputs keeps them
    in between."""
    rows = []
    for out in outputs:
        row = [getattr(out, name) for name in _REQUEST_FIELDS]
        row[_OUTPUTS] = [tuple(getattr(c, name) for name in _COMPLETION_FIELDS) for c in out.outputs]
        if not out.finished and all(len(c.token_ids) > 1 for c in out.outputs):
            row[_PROMPT_IDS] = None
        rows.append(tuple(row))
    return rows


def decode_outputs(rows: list[tuple], prompt_ids: dict[str, list[int] | None]) -> list[RequestOutput]:
    """encode_outputs' inverse. prompt_ids: the requests in flight (the caller adds each, None, before
    sending it, and drops it on abort): filled with the prompt's token ids from the request's first output,
    emptied at its final one. An output of a request no longer there (aborted meanwhile) keeps None."""
    outputs = []
    for row in rows:
        out = RequestOutput(*row)  # encode_outputs' rows hold every field, in the dataclass' order
        out.outputs = [CompletionOutput(*c) for c in out.outputs]
        rid = out.request_id
        if out.prompt_token_ids is None:
            out.prompt_token_ids = prompt_ids.get(rid)
        if out.finished:
            prompt_ids.pop(rid, None)
        elif rid in prompt_ids:
            prompt_ids[rid] = out.prompt_token_ids
        outputs.append(out)
    return outputs


# -- the engine-core process ------------------------------------------------------------------------

def run_engine_core(model, options: dict, inputs, outputs) -> None:
    """The spawned process' main (MPEngineCoreClient): build the LLM, send an EngineCoreInfo (or the
    exception that stopped the build), then serve. inputs / outputs: the read / write ends of two one-way
    pipes. Commands are read on a thread into the core's inbox (a sender never waits for a step); batches
    are pickled and written on another thread, overlapping the next step. The core stops when its input
    pipe closes: the server is gone, and nothing is left to serve."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        import kvpage
        llm = kvpage.LLM(model=model, **options)
        outputs.send(EngineCoreInfo.of(llm))
    except BaseException as e:  # noqa: B036 (the server waits for this answer)
        # The options' own refusals as they are (the CLI answers them with status 2, naming the flag).
        refusal = e if type(e) in (ValueError, TypeError) else \
            RuntimeError(f"the engine core did not start: {type(e).__name__}: {e}")
        outputs.send(refusal)
        raise
    inbox: queue.Queue = queue.Queue()
    outbox: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_commands, args=(inputs, inbox), name="kvpage-core-input", daemon=True)
    writer = threading.Thread(target=_write_batches, args=(outbox, outputs), name="kvpage-core-output")
    reader.start()
    writer.start()
    core = EngineCore(llm.llm_engine, outbox.put)
    codes = []

    def serve() -> None:
        try:
            core.run(inbox)
        except BaseException:  # noqa: B036 (its last batch told the server why)
            codes.append(1)
        finally:
            outbox.put(None)
    # On a thread of its own, not the process' main thread: on the shared 2-core VM, steps issued from a
    # process' main thread ran an order of magnitude slower than the same steps on a second thread (as
    # offline generation did; see bench/serve.py's run_offline). The cause is not known.
    loop = threading.Thread(target=serve, name="kvpage-engine-core")
    loop.start()
    loop.join()
    writer.join()
    llm.shutdown()
    sys.exit(codes[0] if codes else 0)


def _read_commands(inputs, inbox: queue.Queue) -> None:
    while True:
        try:
            command = inputs.recv()
        except (EOFError, OSError):
            inbox.put(Stop())  # the server is gone
            return
        inbox.put(command)


def _write_batches(outbox: queue.Queue, outputs) -> None:
    while (batch := outbox.get()) is not None:
        batch.outputs = encode_outputs(batch.outputs)  # here, off the core's thread: overlaps its next step
        try:
            outputs.send(batch)
        except (BrokenPipeError, OSError):
            return  # the server is gone; the reader's EOF stops the core
