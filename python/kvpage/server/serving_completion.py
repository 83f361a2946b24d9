"""POST /v1/completions: prompts in OpenAI's four forms, echo (with the prompt's log-probabilities, as
lm-eval's loglikelihood requests expect), n choices per prompt, streamed or whole."""
from __future__ import annotations

import json
import time
from typing import AsyncIterator

from kvpage.engine.outputs import CompletionOutput, RequestOutput

from .errors import RequestError
from .logprobs import completion_logprobs
from .protocol import CompletionRequest
from .serving import (ChoiceStream, EnginePrompt, ServingContext, Submitted, chunk_head, json_str, new_id,
                      sampling_params, stream_events, stream_holdback, submit, usage)


def completion_prompts(ctx: ServingContext, prompt) -> list[EnginePrompt]:
    """The prompts as text and token ids (tokenizing: run it on ctx's tokenizer pool)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    out = []
    for item in prompt:
        if isinstance(item, str):
            if ctx.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            out.append(EnginePrompt(item, list(ctx.tokenizer.encode(item))))
        else:
            out.append(EnginePrompt(None, list(item)))
        if not out[-1].token_ids:
            raise RequestError("prompt must not be empty (it has no tokens)", "prompt")
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest) -> CompletionAnswer:
    """Check the request and queue its prompts; the answer then streams or collects the outputs."""
    ctx.check_model(req.model)
    if req.suffix is not None:
        raise RequestError("suffix is not supported", "suffix")
    prompts = await ctx.in_pool(completion_prompts, ctx, req.prompt)
    # OpenAI's default of 16 where the client sent none: lowered to what fits rather than refused.
    sent = req.max_tokens if "max_tokens" in req.model_fields_set else None
    max_tokens = min(ctx.max_tokens(len(p.token_ids), sent, "prompt", n=req.n, default=req.max_tokens)
                     for p in prompts)
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, max_tokens, req.logprobs, prompt_logprobs, defaults=ctx.sampling_defaults)
    return CompletionAnswer(ctx, req, await submit(ctx, new_id("cmpl"), prompts, params, req, "prompt"), params)


class CompletionAnswer:
    """The response of one submitted completion request, whole or as server-sent events."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, sub: Submitted, params) -> None:
        self.ctx, self.req, self.sub = ctx, req, sub
        self.holdback = stream_holdback(params)
        self.created = int(time.time())

    def _body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.sub.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices, **extra}

    def _echo(self, out: RequestOutput) -> tuple[str, list[int], list]:
        """The prompt as echo prepends it: text, token ids, and log-probability entries."""
        if not self.req.echo:
            return "", [], []
        text = out.prompt if out.prompt is not None else self.ctx.tokenizer.decode(out.prompt_token_ids)
        return text, list(out.prompt_token_ids), list(out.prompt_logprobs or [])

    def _choice(self, index: int, text: str, token_ids: list[int], entries: list, reason, offset: int) -> dict:
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = completion_logprobs(token_ids, entries, self.ctx.tokenizer, offset)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    async def whole(self) -> dict:
        final: dict[int, RequestOutput] = {}
        async for i, out in self.sub.outputs():
            if out.finished:
                final[i] = out
        choices = []
        for i in sorted(final):
            out = final[i]
            echo_text, echo_ids, echo_entries = self._echo(out)
            for c in out.outputs:
                choices.append(self._choice(i * self.req.n + c.index, echo_text + c.text, echo_ids + c.token_ids,
                                            echo_entries + (c.logprobs or []), c.finish_reason, 0))
        return self._body(choices, usage=usage([final[i] for i in sorted(final)]))

    def stream(self) -> AsyncIterator[str]:
        """The server-sent events (serving.stream_events), each choice's chunks from _delta."""
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        return stream_events(self.sub, chunk_head(self._body([])), self._delta, self.holdback,
                             (lambda final: self._body([], usage=usage(final))) if include_usage else None)

    def _delta(self, i: int, out: RequestOutput, c: CompletionOutput, state: ChoiceStream) -> str | None:
        """The choice's chunk as JSON, or None where it has nothing to send yet."""
        text, tokens, reason = state.delta(c)
        index = i * self.req.n + c.index
        if self.req.logprobs is None and (state.started or not self.req.echo):
            state.started = True
            if not (text or reason):
                return None
            # json.dumps of _choice(...)'s dict, without encoding it whole.
            return (f'{{"index": {index}, "text": {json_str(text)}, "logprobs": null,'
                    f' "finish_reason": {json_str(reason)}}}')
        token_ids, entries = c.token_ids[tokens], (c.logprobs or [])[tokens]
        if not state.started:
            state.started = True
            echo_text, echo_ids, echo_entries = self._echo(out)
            text, token_ids, entries = echo_text + text, echo_ids + token_ids, echo_entries + entries
        if not (text or reason or (self.req.logprobs is not None and token_ids)):
            return None
        chunk = self._choice(index, text, token_ids, entries, reason, state.text_offset)
        if chunk["logprobs"] is not None:
            state.text_offset += sum(len(t) for t in chunk["logprobs"]["tokens"])
        return json.dumps(chunk)
