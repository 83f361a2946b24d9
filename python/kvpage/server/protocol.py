"""The request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras), as pydantic
models, and the error body every failure answers with.

Strict validation: a string where a number belongs, or a bool where an int belongs, is a 400 naming
the field rather than a silent coercion. Unknown fields are ignored, as OpenAI and vLLM do.
"""
from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's limits where it has them (vLLM's max_logprobs default is 20).
MAX_LOGPROBS = 20
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _utf8_text(cls, value):
        """Every string a tokenizer, a template or a hash may meet must be UTF-8: JSON's "\\ud800" escape
        gives a lone surrogate, which would fail deep inside (a 500) rather than as a 400 naming the field."""
        _check_utf8(value)
        return value


def _check_utf8(value, where: str = "") -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text{where} is not valid UTF-8: a lone surrogate {value[e.start:e.end]!r} at index"
                             f" {e.start}") from None
    elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
        return  # validated already: a list of numbers (token ids) holds nothing else, and may be long
    elif isinstance(value, (list, dict)):
        for i, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(i, str):
                _check_utf8(i, f"{where} (a key)")
            _check_utf8(item, f"{where}[{i!r}]")


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
    allowed_token_ids: list[int] | None = None
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


def logit_bias_token_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids as strings: ASCII digits only (int() would also take "1_0",
    " 7" and non-ASCII digits such as "\u0663")."""
    for key in bias:
        if not re.fullmatch(r"[0-9]{1,18}", key):
            raise ValueError(f"logit_bias keys must be token ids written in ASCII digits, got {key!r}")
    return {int(key): value for key, value in bias.items()}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    kind = "invalid_request_error" if 400 <= status < 500 else ("service_unavailable" if status == 503
                                                                 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
