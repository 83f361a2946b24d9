"""What the completions and chat endpoints share: the server's context, a request's SamplingParams,
running its prompts through the engine loop, per-choice stream deltas, usage and SSE framing."""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from kvpage.engine.generation_defaults import fill_defaults
from kvpage.engine.outputs import CompletionOutput, RequestOutput
from kvpage.engine.sampling_params import SamplingParams

from .engine_loop import EngineDead, EngineLoop, EngineStepError
from .errors import RequestError, field_named_in
from .metrics import ServerMetrics
from .protocol import error_body, logit_bias_token_ids


@dataclass
class ServingContext:
    engine_loop: EngineLoop
    tokenizer: object
    model_name: str
    max_model_len: int | None
    metrics: ServerMetrics
    # The model's generation_config.json sampling defaults, for the fields a request leaves out (vLLM's).
    sampling_defaults: dict = field(default_factory=dict)
    # Where tokenizing, chat templating and detokenizing run: never on the event loop, where a 2 MB prompt
    # (a second of tokenizing) would stall every stream and /health. HF's fast tokenizers release the GIL.
    tokenizer_pool: Executor | None = None

    async def in_pool(self, fn, *args):
        """fn(*args) on the tokenizer pool (its exceptions, RequestError included, raise here)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, functools.partial(fn, *args))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                               code="model_not_found")

    def max_tokens(self, num_prompt: int, sent: int | None, prompt_field: str, max_tokens_field: str = "max_tokens",
                   n: int = 1, default: int | None = None) -> int:
        """The request's max_tokens. Sent: checked against the room the context leaves (a 400 naming the
        field). Not sent: `default` (OpenAI's 16 for completions; None: vLLM's, the room left), lowered
        to what the context and the KV cache can hold for n samples, so that the client is never refused
        over a value it did not send. A prompt of exactly max_model_len tokens is taken, as LLM.generate
        takes it: one token is sampled from it (finish reason "length")."""
        limit = self.max_model_len
        if limit is None:
            return sent if sent is not None else (16 if default is None else default)
        if num_prompt > limit:
            raise RequestError(f"{prompt_field} has {num_prompt} tokens; this model's maximum context length is"
                               f" {limit} tokens", prompt_field)
        room = max(limit - num_prompt, 1)
        if sent is not None:
            if sent > room:
                raise RequestError(f"{max_tokens_field}={sent} is too large: this model's maximum context length"
                                   f" is {limit} tokens and the {prompt_field} has {num_prompt}, leaving {room}",
                                   max_tokens_field)
            return sent
        return self._fitting_max_tokens(num_prompt, room if default is None else min(default, room), n, prompt_field)

    def _fitting_max_tokens(self, num_prompt: int, want: int, n: int, prompt_field: str) -> int:
        """The largest max_tokens <= want with which n samples fit the KV cache in the worst case (the
        scheduler's own admission check, so a hybrid cache's windows count as the scheduler counts them)."""
        scheduler = self.engine_loop.client.info.scheduler

        def fits(max_tokens: int) -> bool:
            try:
                scheduler.check_fits("", num_prompt, max_tokens, n)  # constants only: safe off the loop thread
            except ValueError:
                return False
            return True

        if fits(want):
            return want
        if not fits(1):
            if n == 1:
                raise RequestError(f"{prompt_field} has {num_prompt} tokens, more than this server's KV cache can"
                                   " hold", prompt_field)
            raise RequestError(f"n={n} samples of a {prompt_field} of {num_prompt} tokens do not fit this server's"
                               f" KV cache even with one generated token each; send a smaller n", "n")
        low, high = 1, want  # fits(low), not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                    max_tokens_field: str = "max_tokens", defaults: dict | None = None) -> SamplingParams:
    """The request's SamplingParams; SamplingParams' own checks name the field (400)."""
    if req.use_beam_search:
        raise RequestError("use_beam_search is not supported by this server", "use_beam_search")
    try:
        bias = logit_bias_token_ids(req.logit_bias) if req.logit_bias is not None else None
    except ValueError as e:
        raise RequestError(str(e), "logit_bias") from None
    given = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                 presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                 repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens)
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, logit_bias=bias,
                              allowed_token_ids=req.allowed_token_ids,
                              skip_special_tokens=req.skip_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              **fill_defaults(given, defaults or {}))
    except (ValueError, TypeError) as e:
        param = field_named_in(str(e), type(req).model_fields, {"max_tokens": max_tokens_field})
        raise RequestError(str(e) if param is None or param in str(e) else f"{param}: {e}", param) from None


@dataclass
class EnginePrompt:
    text: str | None
    token_ids: list[int]


class Submitted:
    """A request's prompts, queued in the engine as one engine request each."""

    def __init__(self, ctx: ServingContext, request_id: str, num_prompts: int) -> None:
        self.ctx, self.request_id = ctx, request_id
        self.ids = [f"{request_id}-{i}" for i in range(num_prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: set[str] = set()
        self.arrival = time.perf_counter()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, RequestOutput) as the engine reports them, until every prompt finished.
        Leaving early (the client went away: the consumer is cancelled or closes this) aborts the
        unfinished ones, which frees their blocks before the engine's next step."""
        async with aclosing(self.batches()) as batches:
            async for batch in batches:
                for item in batch:
                    yield item

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """outputs(), one list per wake-up of the handler: what a step (or the steps since the last
        wake-up) produced, so that a stream writes it to its client at once."""
        index_of = {rid: i for i, rid in enumerate(self.ids)}
        try:
            while self.pending:
                batch = []
                for out in await self._latest():
                    if out.finished:
                        self.pending.discard(out.request_id)
                        self.ctx.metrics.observe_finished(out, self.arrival)
                    batch.append((index_of[out.request_id], out))
                yield batch
        finally:
            self.abort()

    async def _latest(self) -> list[RequestOutput]:
        """Every output queued by now, only the latest per request: outputs are cumulative, so a
        consumer that fell behind (a slow client, a busy event loop) catches up in one go."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        latest: dict[str, RequestOutput] = {}
        for item in items:
            if isinstance(item, EngineStepError):
                self.pending.clear()  # the loop withdrew them all
                raise item
            latest[item.request_id] = item
        return list(latest.values())

    def abort(self) -> None:
        if self.pending:
            self.ctx.engine_loop.abort(self.pending)
            self.pending = set()


async def submit(ctx: ServingContext, request_id: str, prompts: list[EnginePrompt], params: SamplingParams,
                 req, prompt_field: str) -> Submitted:
    """Queue every prompt, or none: a prompt the engine refuses withdraws the others and raises
    RequestError naming the field (QueueFull where the waiting queue is full)."""
    sub = Submitted(ctx, request_id, len(prompts))
    try:
        for i, (rid, prompt) in enumerate(zip(sub.ids, prompts)):
            sub.pending.add(rid)  # before the await: a client gone during it still has this one aborted
            try:
                await ctx.engine_loop.add_request(rid, prompt.text, prompt.token_ids, params, req.cache_salt,
                                                  sub.queue)
            except (ValueError, TypeError) as e:
                sub.pending.discard(rid)
                # The scheduler's messages lead with the internal request id: the client's index instead.
                message = str(e).split(": ", 1)[-1] if str(e).startswith("request ") else str(e)
                if len(prompts) > 1:
                    message = f"prompt {i}: {message}"
                param = field_named_in(message, type(req).model_fields, {"prompt": prompt_field})
                raise RequestError(message, param) from None
    except BaseException:
        sub.abort()
        raise
    return sub


@dataclass
class ChoiceStream:
    """What one choice has sent so far. Text is held back by the longest stop string less one
    character until the choice finishes: a stop string completed by a later token truncates text
    that would otherwise have gone out already."""
    holdback: int = 0
    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False
    started: bool = False  # a first chunk went out (chat's role, completions' echo)
    text_offset: int = 0  # completions' logprobs: characters before the next token

    def delta(self, c: CompletionOutput) -> tuple[str, slice, str | None]:
        """(new text, slice of the new token ids, finish reason if it just finished)."""
        end = len(c.text) if c.finished else max(self.text_sent, len(c.text) - self.holdback)
        text, self.text_sent = c.text[self.text_sent:end], end
        tokens, self.tokens_sent = slice(self.tokens_sent, len(c.token_ids)), len(c.token_ids)
        self.finished = c.finished
        return text, tokens, c.finish_reason


# A stream's delta function: (prompt index, its RequestOutput, one of its choices, that choice's ChoiceStream) ->
# the choice's chunk as JSON, or None where it has nothing to send yet.
ChoiceDelta = Callable[[int, RequestOutput, CompletionOutput, ChoiceStream], "str | None"]


async def stream_events(sub: Submitted, head: str, delta: ChoiceDelta, holdback: int,
                        usage_body=None) -> AsyncIterator[str]:
    """An endpoint's server-sent events, the events of each wake-up in one piece (one write to the client): a
    step's chunks (sse_chunk(head, delta(...)) per choice that has something new), and with the last one the
    usage event (usage_body(the final output of every prompt, in order), where given) and [DONE]. An engine or
    request error ends the stream with its error event and [DONE]."""
    choices: dict[tuple[int, int], ChoiceStream] = {}
    final: dict[int, RequestOutput] = {}
    events: list[str] = []
    try:
        async with aclosing(sub.batches()) as batches:
            async for batch in batches:
                for i, out in batch:
                    for c in out.outputs:
                        state = choices.get((i, c.index))
                        if state is None:
                            state = choices[(i, c.index)] = ChoiceStream(holdback)
                        if not state.finished:
                            chunk = delta(i, out, c, state)
                            if chunk is not None:
                                events.append(sse_chunk(head, chunk))
                    if out.finished:
                        final[i] = out
                if sub.pending and events:
                    yield "".join(events)
                    events = []
        if usage_body is not None:
            events.append(sse(usage_body([final[i] for i in sorted(final)])))
    except (EngineStepError, RequestError) as e:
        events.append(sse_error(e))
    events.append(sse("[DONE]"))
    yield "".join(events)


def stream_holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1


def usage(final: list[RequestOutput]) -> dict:
    """OpenAI's usage from the final output of every prompt; cached_tokens from the prefix cache."""
    prompt = sum(len(o.prompt_token_ids) for o in final)
    completion = sum(len(c.token_ids) for o in final for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens or 0 for o in final)}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# A stream writes one event per token per request: its chunks are filled into templates rather than encoded
# whole by json.dumps, byte for byte what sse(body) writes (the client's bytes do not change).
_json_str = json.encoder.encode_basestring_ascii  # json.dumps of a str (ensure_ascii, json.dumps' default)


def json_str(text: str | None) -> str:
    """json.dumps(text) for a str or None."""
    return "null" if text is None else _json_str(text)


def chunk_head(body: dict) -> str:
    """json.dumps(body), whose "choices" is empty and its last key, up to and with the choices' "[": a stream's
    chunk events are written as sse_chunk(head, choice)."""
    text = json.dumps(body)
    if not (text.endswith('"choices": []}') and isinstance(body.get("choices"), list)):
        raise ValueError(f"chunk_head needs a body that ends with empty choices, got {text[-40:]!r}")
    return text[:-2]


def sse_chunk(head: str, choice: str) -> str:
    """sse(body) for body = chunk_head's with one choice, choice being json.dumps of that choice."""
    return f"data: {head}{choice}]}}\n\n"


def sse_error(error: Exception) -> str:
    if isinstance(error, RequestError):
        return sse(error_body(error.message, error.status, error.param, error.code))
    if isinstance(error, EngineDead):
        return sse(error_body(str(error), 503, code="engine_dead"))
    return sse(error_body(str(error), 500, code="engine_error"))
