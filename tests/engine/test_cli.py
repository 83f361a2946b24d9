"""The kvpage command, run in-process on the session's default model (model loading is cached)."""
from __future__ import annotations

from kvpage import cli


def test_cli_generate_greedy(llm, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    assert cli.main(["generate", "The capital of France is", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_bad_argument_is_an_error_not_a_crash(llm, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    assert cli.main(["generate", "hi", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
