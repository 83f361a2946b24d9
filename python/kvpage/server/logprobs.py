"""The engine's per-token {token_id: Logprob} dicts in OpenAI's two formats: completions'
(tokens / token_logprobs / top_logprobs / text_offset) and chat's (content: [{token, logprob, bytes,
top_logprobs}])."""
from __future__ import annotations

from kvpage.engine.outputs import Logprob


def token_text(token_id: int, entry: dict[int, Logprob] | None, tokenizer) -> str:
    lp = entry.get(token_id) if entry else None
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else ""


def completion_logprobs(token_ids: list[int], entries: list, tokenizer, text_offset: int) -> dict:
    """entries[i]: token_ids[i]'s dict (the sampled or prompt token first, then the top ones), or None
    for the first prompt token, which nothing precedes (null in the response, as OpenAI's echo)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = token_text(token_id, entry, tokenizer)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry[token_id].logprob)
        out["top_logprobs"].append({token_text(t, entry, tokenizer): lp.logprob for t, lp in entry.items()})
    return out


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list, tokenizer, top_logprobs: int) -> dict:
    """Chat's format: per token its own entry and the top_logprobs most likely, best first."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        item = _chat_entry(token_text(token_id, entry, tokenizer), entry[token_id].logprob)
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_logprobs]
        item["top_logprobs"] = [_chat_entry(token_text(t, entry, tokenizer), lp.logprob) for t, lp in best]
        content.append(item)
    return {"content": content}
