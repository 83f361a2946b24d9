"""The request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras), as pydantic
models, and the error body every failure answers with.

Strict validation: a string where a number belongs, or a bool where an int belongs, is a 400 naming
the field rather than a silent coercion. Unknown fields are ignored, as OpenAI and vLLM do.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's limits where it has them (vLLM's max_logprobs default is 20).
MAX_LOGPROBS = 20
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share: OpenAI's sampling fields and vLLM's extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    use_beam_search: bool = False


# A prompt: text, a list of texts, token ids, or a list of token-id lists (OpenAI's four forms).
Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    kind = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
            503: "service_unavailable"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
