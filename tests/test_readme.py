"""Every code block of README.md runs as written: each python block in a fresh interpreter (on the embedded
default model, as a reader would run it), and every `kvpage ...` / `python -m kvpage ...` command, in a shell
block or inline, parses with the command's own parser. The set-up block is what .ci/run extracts."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvpage import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


def kvpage_commands() -> list[str]:
    """The `kvpage` command lines the README shows: in shell blocks (split at && || ; |) and inline."""
    pieces = [part for block in code_blocks("bash") for line in block.replace("\\\n", " ").splitlines()
              for part in re.split(r"&&|\|\||;|\|", line)]
    pieces += re.findall(r"`((?:python -m )?kvpage [^`]*)`", README.replace("\n", " "))
    commands = [p.strip().removesuffix("&").strip() for p in pieces]
    return sorted({c for c in commands if re.match(r"(python -m )?kvpage \w", c)})


@pytest.mark.parametrize("code", code_blocks("python"), ids=lambda code: code.split("\n")[0][:40])
def test_python_block_runs_as_written(code, tmp_path):
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TQDM_DISABLE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), run.stderr[-3000:]
    if "capital of France" in code:  # the answer its comment shows
        assert "Paris" in run.stdout, run.stdout


def test_the_readme_shows_kvpage_commands():
    names = {shlex.split(c)[2 if c.startswith("python") else 1] for c in kvpage_commands()}
    assert {"demo", "generate", "chat", "serve", "bench", "plan"} <= names, names


@pytest.mark.parametrize("command", kvpage_commands())
def test_kvpage_command_parses(command):
    argv = shlex.split(command)
    argv = argv[3:] if argv[0] == "python" else argv[1:]
    argv = [word for word in argv if word != "[MODEL]"]  # a placeholder
    cli.build_parser().parse_args(argv)  # a flag it does not know exits 2, naming it


def test_set_up_block_is_the_ci_command():
    """.ci/run takes the first bash block's second line as the test command; the first runs the demo."""
    extract = "awk '/^```bash/{inside=1; next} inside && /^```/{exit} inside{print}' README.md"
    lines = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    first, second = lines.splitlines()[:2]
    assert first.endswith("python -m kvpage demo") and second.endswith("python -m pytest -q"), lines
    assert 'pip install -e ".[test]"' in second  # on a fresh machine it installs everything itself


def test_set_up_check_passes_once_installed():
    """The test command's guard (before its ||) succeeds where kvpage and its test extra are installed, as here:
    after the first command it reinstalls nothing."""
    run = subprocess.run(["bash", "-c", set_up_check()], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_set_up_check_fails_in_another_checkout(tmp_path):
    """Run from a checkout that is not the installed one (a CI clone where another checkout's kvpage is
    installed), the guard fails, so the command installs this checkout instead of testing another's code."""
    (tmp_path / "python" / "kvpage").mkdir(parents=True)
    (tmp_path / "python" / "kvpage" / "__init__.py").write_text("")
    run = subprocess.run(["bash", "-c", set_up_check()], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "AssertionError" in run.stderr, run.stderr[-2000:]


def set_up_check() -> str:
    """The test command's guard, the part before its ||, with its errors shown."""
    return code_blocks("bash")[0].splitlines()[1].split("||")[0].replace("2>/dev/null", "")


def test_curl_body_is_a_valid_request():
    from kvpage.server.protocol import ChatCompletionRequest

    bodies = [json.loads(body) for body in re.findall(r"-d '(\{.*?\})'", README.replace("\\\n", " "), flags=re.S)]
    assert bodies
    for body in bodies:
        ChatCompletionRequest.model_validate(body)
