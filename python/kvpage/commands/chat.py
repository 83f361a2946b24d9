"""`kvpage chat`: a conversation with the model, each reply streamed token by token.

Each turn sends the chat template over the whole conversation, so the model reads every earlier turn;
the prefix cache holds their K/V from the turn before, so only the new message is computed."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation and start a new one",
    "/exit": "leave (as do /quit, Ctrl-D, or Ctrl-C at the prompt)",
}
HELP = "\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items()) + \
    "\n  Ctrl-C during a reply stops the reply; everything else is sent to the model."


@dataclass
class Conversation:
    """The messages so far, as the chat template wants them."""
    messages: list[dict] = field(default_factory=list)

    def prompt(self, tokenizer, user_text: str) -> str:
        """Add the user's message; the text the model reads next: the whole conversation, templated."""
        self.messages.append({"role": "user", "content": user_text})
        return tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def reset(self) -> None:
        self.messages.clear()


@dataclass
class Reply:
    text: str
    num_tokens: int
    seconds: float
    ttft: float | None
    num_cached_tokens: int | None

    def summary(self) -> str:
        """One line after the reply: speed, and what the prefix cache saved."""
        parts = [f"{self.num_tokens} tokens, {self.num_tokens / max(self.seconds, 1e-9):.1f} tok/s"]
        if self.ttft is not None:
            parts.append(f"first token after {self.ttft:.2f} s")
        if self.num_cached_tokens:
            parts.append(f"{self.num_cached_tokens} prompt tokens from the prefix cache")
        return f"[{', '.join(parts)}]"


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def run_chat(llm, params, show_prompt: bool = False) -> None:
    tokenizer = llm.tokenizer
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template; use kvpage generate --raw to continue text")
    conversation, request_ids = Conversation(), itertools.count()
    print("kvpage chat: type a message; /help lists the commands, /exit leaves.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not line:
            continue
        if line.startswith("/"):
            if not _command(line, conversation):
                return
            continue
        text = conversation.prompt(tokenizer, line)
        if show_prompt:
            print(f"[prompt]\n{text}\n[reply]")
        token_ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        request_id, start = f"chat-{next(request_ids)}", time.perf_counter()
        try:
            llm.llm_engine.add_request(request_id, text, params, prompt_token_ids=token_ids)
        except ValueError as e:  # refused: the conversation has outgrown the model or the KV cache
            conversation.messages.pop()
            print(f"[not sent: {e}; /reset starts a new conversation]")
            continue
        reply = stream_reply(llm.llm_engine, request_id, start)
        conversation.add_reply(reply.text)
        print(reply.summary())


def _command(line: str, conversation: Conversation) -> bool:
    """Run a /command (never sent to the model); False to leave."""
    name = line.split()[0].lower()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        conversation.reset()
        print("[conversation reset]")
    elif name == "/help":
        print(HELP)
    else:
        print(f"unknown command {name}; /help lists them")
    return True


def stream_reply(engine, request_id: str, start: float, strip: bool = False) -> Reply:
    """Print one queued request's reply as it grows (strip: without its leading whitespace); Ctrl-C ends
    it early (the request is aborted, its blocks freed) and what was shown so far is the reply."""
    shown, last = "", None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                reply = out.outputs[0].text.lstrip() if strip else out.outputs[0].text
                print(reply[len(shown):], end="", flush=True)
                shown, last = reply, out
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print(" [stopped]", end="")
    print()
    seconds = time.perf_counter() - start
    if last is None:
        return Reply(shown, 0, seconds, None, None)
    return Reply(shown, len(last.outputs[0].token_ids), seconds, last.metrics.get("ttft"), last.num_cached_tokens)
