"""POST /v1/chat/completions: the messages through the tokenizer's chat template (as LLM.chat does),
n choices, logprobs in chat's format, streamed or whole."""
from __future__ import annotations

import json
import time
from typing import AsyncIterator

from kvpage.engine.outputs import CompletionOutput, RequestOutput
from kvpage.engine.prompt_inputs import chat_template_prompt, normalise_conversations

from .errors import RequestError
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, ChatMessage
from .serving import (ChoiceStream, EnginePrompt, ServingContext, Submitted, chunk_head, json_str, new_id,
                      sampling_params, stream_events, stream_holdback, submit, usage)


def _content(message: ChatMessage) -> str | None:
    if message.content is None or isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def chat_prompt(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True) -> EnginePrompt:
    """The conversation as the chat template writes it, and its token ids (the template wrote the
    special tokens already, so they are not added again). Slow for a long conversation: run it on
    ctx's tokenizer pool."""
    tokenizer = ctx.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template: use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": _content(m), **({"name": m.name} if m.name else {})}
                    for m in messages]
    try:
        # LLM.chat's checks and its template call: both doors take and refuse the same conversations (an
        # assistant message without content is taken, as OpenAI takes it; a user's is refused).
        [conversation] = normalise_conversations(conversation)
        text, token_ids = chat_template_prompt(tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    except ValueError as e:  # chat_template_prompt's include the template's raise_exception (roles out of order)
        raise RequestError(f"messages: {e}" if not str(e).startswith("messages") else str(e), "messages") from None
    return EnginePrompt(text, token_ids)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest) -> ChatAnswer:
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    prompt = await ctx.in_pool(chat_prompt, ctx, req.messages, req.add_generation_prompt)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = ctx.max_tokens(len(prompt.token_ids), getattr(req, name), "messages", name, n=req.n)
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                             max_tokens_field=name, defaults=ctx.sampling_defaults)
    return ChatAnswer(ctx, req, await submit(ctx, new_id("chatcmpl"), [prompt], params, req, "messages"), params)


class ChatAnswer:
    """The response of one submitted chat request, whole or as server-sent events."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, sub: Submitted, params) -> None:
        self.ctx, self.req, self.sub = ctx, req, sub
        self.holdback = stream_holdback(params)
        self.created = int(time.time())

    def _body(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.sub.request_id, "object": obj, "created": self.created, "model": self.ctx.model_name,
                "choices": choices, **extra}

    def _logprobs(self, token_ids: list[int], entries: list) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(token_ids, entries, self.ctx.tokenizer, self.req.top_logprobs or 0)

    async def whole(self) -> dict:
        final: RequestOutput | None = None
        async for _, out in self.sub.outputs():
            final = out
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs or []), "finish_reason": c.finish_reason}
                   for c in final.outputs]
        return self._body("chat.completion", choices, usage=usage([final]))

    def stream(self) -> AsyncIterator[str]:
        """The server-sent events (serving.stream_events), each choice's chunks from _delta (one prompt)."""
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        return stream_events(self.sub, chunk_head(self._body("chat.completion.chunk", [])),
                             lambda _, out, c, state: self._delta(c, state), self.holdback,
                             (lambda final: self._body("chat.completion.chunk", [], usage=usage(final)))
                             if include_usage else None)

    def _delta(self, c: CompletionOutput, state: ChoiceStream) -> str | None:
        """The choice's chunk as JSON, or None where it has nothing to send yet."""
        text, tokens, reason = state.delta(c)
        if state.started and not self.req.logprobs:
            if not (text or reason):
                return None
            # json.dumps of the general case's dict, without encoding it whole.
            delta = f'{{"content": {json_str(text)}}}' if text else "{}"
            return f'{{"index": {c.index}, "delta": {delta}, "logprobs": null, "finish_reason": {json_str(reason)}}}'
        delta = {"content": text} if text or not state.started else {}
        if not state.started:
            state.started = True
            delta["role"] = "assistant"
        elif not (text or reason or (self.req.logprobs and c.token_ids[tokens])):
            return None
        return json.dumps({"index": c.index, "delta": delta,
                           "logprobs": self._logprobs(c.token_ids[tokens], (c.logprobs or [])[tokens]),
                           "finish_reason": reason})
