"""`kvpage generate`: one prompt, its answer streamed token by token as the engine produces it (--no-stream:
printed once whole, for scripts).

A question goes through the model's chat template (as `vllm chat` and `ollama run` do); --raw, or a model
without a template, continues the text as is."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .chat import has_chat_template, stream_reply

# Room for what a chat template adds around the question (SmolLM2's: about 30 tokens), for the cheap bound
# below that spares loading the tokenizer for an ordinary prompt.
TEMPLATE_TOKENS = 256


def run_generate(llm, prompt: str, params, raw: bool, stream: bool = True, show_prompt: bool = False) -> str:
    """Print the answer (stdout holds only it, and the prompt with show_prompt); returns its text."""
    chat = not raw and has_chat_template(llm.tokenizer)
    if not stream:
        return _print_whole(llm, prompt, params, chat, raw, show_prompt)
    engine = llm.llm_engine
    request_id, start = "generate", time.perf_counter()
    if chat:
        from kvpage.engine.prompt_inputs import chat_template_prompt
        text, token_ids = chat_template_prompt(llm.tokenizer, [{"role": "user", "content": prompt}])
    else:
        text, token_ids = prompt, None
    if show_prompt:
        print(f"[prompt]\n{text}\n[reply]", flush=True)
    try:
        engine.add_request(request_id, text, params, prompt_token_ids=token_ids)
    except ValueError as e:  # the engine names the request; here there is only one
        raise ValueError(str(e).removeprefix(f"request {request_id!r}: ")) from None
    return stream_reply(engine, request_id, start, strip=not raw).text


def _print_whole(llm, prompt: str, params, chat: bool, raw: bool, show_prompt: bool) -> str:
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    if show_prompt:
        print(f"[prompt]\n{out.prompt}\n[reply]")
    text = out.outputs[0].text if raw else out.outputs[0].text.strip()
    print(text)
    return text


def check_prompt_fits(model: str | None, prompt: str, raw: bool, max_model_len: int | None) -> None:
    """ValueError, before the model loads (15-30 s), for a prompt longer than the context: the model's
    config.json gives the context, its tokenizer (loaded only for a prompt that could be that long: a
    token is at least one byte) the prompt's length. The engine refuses it too, but only once loaded."""
    path = Path(model) if model is not None else _default_model_dir()
    config = json.loads((path / "config.json").read_text())
    limit = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if max_model_len is not None and (limit is None or max_model_len < limit):
        limit = max_model_len
    if limit is None or len(prompt.encode()) + (0 if raw else TEMPLATE_TOKENS) + 1 <= limit:
        return
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not raw and has_chat_template(tokenizer):
        from kvpage.engine.prompt_inputs import chat_template_prompt
        num_tokens = len(chat_template_prompt(tokenizer, [{"role": "user", "content": prompt}])[1])
    else:
        num_tokens = len(tokenizer.encode(prompt))
    if num_tokens > limit:
        raise ValueError(f"the prompt has {num_tokens} tokens, more than the model's context of {limit}"
                         f" (max_model_len)")


def _default_model_dir() -> Path:
    from kvpage.model.loader import default_model_dir
    return default_model_dir()
