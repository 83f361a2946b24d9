"""`kvpage chat` driven as a person would, through a pseudo-terminal (pexpect), on a tiny random model:
what each turn's prompt holds is printed by --show-prompt and compared with the chat template over the
conversation as it should be."""
from __future__ import annotations

import re
import sys

import pexpect
import pytest

import kvpage
from kvpage.commands.chat import Conversation, run_chat

TURN = re.compile(r"\[prompt\]\r\n(.*?)\r\n\[reply\]\r\n(.*?)\r\n\[(\d+) tokens, [\d.]+ tok/s[^\]]*\]\r\n", re.S)


def _template(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _turn(child, text: str) -> tuple[str, str]:
    """Send one message; (the prompt the model read, its reply), as printed."""
    child.sendline(text)
    child.expect(TURN)
    prompt, reply, num_tokens = (g.replace("\r\n", "\n") for g in child.match.groups())
    assert int(num_tokens) >= 1
    child.expect_exact("> ")
    return prompt, reply


@pytest.fixture
def chat(tiny_model_dir):
    child = pexpect.spawn(sys.executable, ["-m", "kvpage", "chat", "--model", str(tiny_model_dir), "--temperature",
                                           "0", "--max-tokens", "4", "--show-prompt"], encoding="utf-8", timeout=120)
    child.expect_exact("/help lists the commands")
    child.expect_exact("> ")
    yield child
    child.close(force=True)


def test_chat_keeps_the_conversation_and_its_commands(chat, tokenizer):
    first, reply = _turn(chat, "My name is Ada.")
    assert first == _template(tokenizer, [{"role": "user", "content": "My name is Ada."}])

    # The second turn's prompt holds the first turn: the question and the reply as printed.
    second, _ = _turn(chat, "What is my name?")
    assert second == _template(tokenizer, [{"role": "user", "content": "My name is Ada."},
                                           {"role": "assistant", "content": reply},
                                           {"role": "user", "content": "What is my name?"}])

    chat.sendline("/help")  # a command: listed, never sent to the model
    chat.expect_exact("> ")
    assert all(name in chat.before for name in ("/reset", "/exit", "/help")) and "[prompt]" not in chat.before

    chat.sendline("/reset")
    chat.expect_exact("[conversation reset]")
    chat.expect_exact("> ")
    third, _ = _turn(chat, "Hello again.")
    assert third == _template(tokenizer, [{"role": "user", "content": "Hello again."}])

    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.wait()
    assert chat.exitstatus == 0 and "Traceback" not in chat.before


def test_ctrl_d_leaves(chat):
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.wait()
    assert chat.exitstatus == 0


def test_conversation_prompt_holds_every_turn(tokenizer):
    conversation = Conversation()
    conversation.prompt(tokenizer, "Hi")
    conversation.add_reply("Hello!")
    text = conversation.prompt(tokenizer, "Bye")
    assert text.index("Hi") < text.index("Hello!") < text.index("Bye")
    conversation.reset()
    assert "Hello!" not in conversation.prompt(tokenizer, "Again")


def test_reply_streams_step_by_step(tiny_model_dir, capsys, monkeypatch):
    """The reply reaches the terminal as the steps sample it, not once at the end."""
    llm = kvpage.LLM(model=str(tiny_model_dir), num_kv_blocks=64)
    engine, seen = llm.llm_engine, []
    real_step = engine.step

    def step():
        seen.append(capsys.readouterr().out)  # what was printed before this step
        return real_step()

    lines = iter(["Tell me a story.", "/exit"])
    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    run_chat(llm, kvpage.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    # seen[0] holds the banner; each later entry what one step printed: a token's text (a few may be empty,
    # a UTF-8 character still incomplete), so the six tokens came out over several steps.
    assert len([chunk for chunk in seen[1:] if chunk]) >= 4, seen


def test_a_message_the_cache_cannot_hold_is_refused_and_the_chat_goes_on(tiny_model_dir, capsys, monkeypatch):
    llm = kvpage.LLM(model=str(tiny_model_dir), num_kv_blocks=4)  # 64 tokens
    shown = []
    real_add = llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request", lambda rid, text, *a, **k: shown.append(text) or
                        real_add(rid, text, *a, **k))
    lines = iter(["word " * 100, "Hi", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    run_chat(llm, kvpage.SamplingParams(temperature=0, max_tokens=2))
    out = capsys.readouterr().out
    assert "[not sent: " in out and "/reset starts a new conversation]" in out
    assert "word" not in shown[-1] and "Hi" in shown[-1]  # the refused message left the conversation
