"""The `kvpage` command's mistakes: each is one line naming the flag, from the subcommand's own parser,
before the model loads (no torch imported) and within 3 s of the command starting."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from kvpage import cli

CASES = [
    (["generate", ""], "kvpage generate: error: the prompt is empty"),
    (["generate", "   "], "kvpage generate: error: the prompt is empty"),
    (["generate", "hi", "--temperature", "-1"], "kvpage generate: error: --temperature must be"),
    (["generate", "hi", "--top-p", "2"], "kvpage generate: error: --top-p must be in (0, 1]"),
    (["generate", "hi", "--max-tokens", "0"], "kvpage generate: error: --max-tokens must be"),
    (["chat", "--presence-penalty", "3"], "kvpage chat: error: --presence-penalty must be a number in [-2, 2]"),
    (["chat", "--model", "/no/such/dir"], "kvpage chat: error: --model /no/such/dir: not a local HF model directory"),
    (["demo", "--repetition-penalty", "0"], "kvpage demo: error: --repetition-penalty must be"),
    (["generate", "hi", "--bogus"], "kvpage generate: error: unrecognized arguments: --bogus"),
    (["generate", "hi", "--temperature", "warm"], "kvpage generate: error: argument --temperature: invalid float"),
    (["bench", "--num-kv-blocks", "0"], "kvpage bench: error: argument --num-kv-blocks: must be at least 1"),
    # A mistyped flag: a suggestion, and the words after it (its value and the prompt) are not blamed.
    (["generate", "--max-tokns", "20", "What is the capital of France?"],
     "kvpage generate: error: unrecognized arguments: --max-tokns (did you mean --max-tokens?)\n"),
    (["chat", "--temprature=0"], "kvpage chat: error: unrecognized arguments: --temprature=0 (did you mean"
                                 " --temperature?)\n"),
    (["serve", "--prot", "8001"], "kvpage serve: error: unrecognized arguments: --prot (did you mean --port?)\n"),
    (["generat", "hi"], "kvpage: error: argument command: invalid choice: 'generat' (choose from"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_mistake_is_one_line_within_3_seconds(argv, message):
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "kvpage", *argv], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert run.returncode == 2 and run.stdout == "", run
    error_lines = [line + "\n" for line in run.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and error_lines[0].startswith(message), run.stderr
    assert "Traceback" not in run.stderr
    assert elapsed < 3.0, f"{elapsed:.1f} s"


@pytest.mark.parametrize("argv", [a for a, _ in CASES[:8]], ids=[" ".join(a) for a, _ in CASES[:8]])
def test_mistake_is_found_before_torch_loads(argv):
    """Checked with pure-Python code: the model (and torch) is never reached."""
    code = f"import sys; from kvpage.cli import main; rc = main({argv!r}); print(rc, 'torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["2", "False"], run


def test_mistyped_subcommand_is_suggested(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generat", "hi"])
    assert capsys.readouterr().err.rstrip().endswith("(did you mean generate?)")


def test_unknown_flag_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["chat", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: kvpage chat [options]"), err


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", ["generate", "chat", "demo", "bench", "plan", "serve"])
def test_help_shows_every_default(command):
    parser = _subparsers(cli.build_parser())[command]
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    text = parser.format_help()
    for action in options:
        flag = action.option_strings[0]
        entry = text[text.index(f"  {flag}"):]
        entry = entry[:entry.index("\n  -", 1)] if "\n  -" in entry[1:] else entry
        assert "(default:" in entry, f"{command} {flag}: {entry}"


def test_enforce_eager_runs_generate(tiny_model_dir):
    """--enforce-eager reaches LLM(enforce_eager=True); on a CPU every step is eager anyway."""
    run = subprocess.run([sys.executable, "-m", "kvpage", "generate", "--model", str(tiny_model_dir), "--enforce-eager",
                          "--max-tokens", "3", "--temperature", "0", "--raw", "Hello"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
