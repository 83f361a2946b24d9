"""The prompts of a generate() / chat() call as the engine takes them: vLLM's prompt forms (a string,
token ids, or a prompt dict with an optional cache salt) normalised, one SamplingParams per prompt."""
from __future__ import annotations

from dataclasses import dataclass

from .chat_tokens import encode_chat_text
from .sampling_params import SamplingParams, check_encodable


@dataclass
class PromptItem:
    """One prompt of a generate() / chat() call: its text or ids (add_request's prompt and
    prompt_token_ids), its params and its cache salt."""

    prompt: str | list[int] | None
    token_ids: list[int] | None
    params: SamplingParams
    cache_salt: str | None = None


_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def normalise_prompts(prompts) -> list[tuple]:
    """(prompt, prompt_token_ids, cache_salt) per prompt: strings, token-id lists, and vLLM's prompt
    dicts, {"prompt": text} or {"prompt_token_ids": ids}, each with an optional "cache_salt"."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]  # a single prompt of token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a non-empty list of strings or a list of token-id lists")
    return [_normalise_prompt(i, p) for i, p in enumerate(prompts)]


def _normalise_prompt(i: int, p) -> tuple:
    if isinstance(p, (str, list, tuple)):
        return p, None, None
    if not isinstance(p, dict):
        raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a prompt dict, got {type(p).__name__}")
    if set(p) - _PROMPT_KEYS or not {"prompt", "prompt_token_ids"} & set(p):
        raise ValueError(f"prompts[{i}] must be a dict of 'prompt' (text) or 'prompt_token_ids', and optionally"
                         f" 'cache_salt'; got keys {sorted(p)}")
    text, ids = p.get("prompt"), p.get("prompt_token_ids")
    if (text is not None and not isinstance(text, str)) or (ids is not None and not isinstance(ids, (list, tuple))):
        raise ValueError(f"prompts[{i}]: 'prompt' must be a string and 'prompt_token_ids' a list of token ids")
    if ids is not None:  # a text beside the ids is only reported back, as in vLLM
        return text, list(ids), p.get("cache_salt")
    return text, None, p.get("cache_salt")


def per_prompt_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        return list(sampling_params)
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")


def chat_template_prompt(tokenizer, conversation: list[dict], chat_template: str | None = None,
                         add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """A conversation as the chat template writes it, and its token ids: the template wrote the special
    tokens already, so encoding does not add them again."""
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except TemplateError as e:  # a broken template, or its raise_exception (roles out of order, ...)
        raise ValueError(f"chat_template: {type(e).__name__}: {e}") from None
    return text, encode_chat_text(tokenizer, text)  # == tokenizer.encode(text, add_special_tokens=False)


_ROLES = ("system", "user", "assistant", "tool", "developer")


def normalise_conversations(messages) -> list[list[dict]]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them, checked: ValueError
    naming the message for a missing or non-text content, an unknown role or text that is not UTF-8,
    instead of whatever the chat template's renderer would raise. As OpenAI, an assistant message may
    come without content (None or no key): the conversations returned (copies) give it "" instead."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or of such lists)")
    conversations = [messages] if isinstance(messages[0], dict) else messages
    for c, conversation in enumerate(conversations):
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(f"messages[{c}] must be a non-empty list of {{'role', 'content'}} dicts")
        for m, message in enumerate(conversation):
            _check_message(message, f"messages[{c}][{m}]" if len(conversations) > 1 else f"messages[{m}]")
    return [[_with_content(message) for message in conversation] for conversation in conversations]


def _with_content(message: dict) -> dict:
    if message.get("content") is None:  # an assistant's (_check_message refused any other)
        return {**message, "content": ""}
    return message


def _check_message(message, where: str) -> None:
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise ValueError(f"{where}: role must be one of {list(_ROLES)}, got {role!r}")
    if role == "assistant" and content is None:
        return
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string, got "
                         + ("nothing" if "content" not in message else repr(type(content).__name__)))
    check_encodable(content, f"{where} content")
