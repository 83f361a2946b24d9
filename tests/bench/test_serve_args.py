"""bench/serve.py --max-num-batched-tokens N gives every side of the serve benchmark the same step budget: the
flag reaches offline LLM(...)'s arguments, each `kvpage serve` command line (as kvpage's own parser reads it)
and the `vllm serve` command line, and a value below 1 is refused naming the flag. No server starts: the
process launcher is replaced by one that records each command line."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

from kvpage.cli import build_parser as kvpage_parser
from kvpage.engine.arg_utils import SERVE_DEFAULTS, engine_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # serve.py's own imports (common, peers)
import serve  # noqa: E402
import serve_servers  # noqa: E402

FLAG = "--max-num-batched-tokens"
VLLM_DEFAULT = inspect.signature(serve_servers.vllm_launcher.serve_argv).parameters["max_num_batched_tokens"].default


class RecordedLLM:
    """Stands in for kvpage.LLM: keeps its keyword arguments, loads nothing."""
    calls: list[dict] = []

    def __init__(self, **kwargs):
        RecordedLLM.calls.append(kwargs)

    def shutdown(self) -> None:
        pass


class NoProcess:
    def __init__(self, name: str):
        self.name = name

    def stop(self) -> None:
        pass


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Every server start recorded as {name: argv} instead of run; offline LLM(...) recorded too."""
    argvs: dict[str, list[str]] = {}

    def start_server(name, argv, env, log_dir, timeout_s=600):
        argvs[name] = [str(a) for a in argv(12345)]
        return NoProcess(name)

    RecordedLLM.calls = []
    monkeypatch.setattr(serve_servers, "start_server", start_server)
    monkeypatch.setattr(serve.kvpage, "LLM", RecordedLLM)
    monkeypatch.setattr(serve, "_kv_blocks", lambda model_dir, gib: 64)  # no model config read
    monkeypatch.setattr(serve, "_rounds", lambda *args, **kwargs: {})
    monkeypatch.setattr(serve, "RESULTS_DIR", tmp_path)  # the servers' log directory
    return argvs


def flag_values(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == FLAG]


def run_rounds_with(budget: int | None, tmp_path: Path) -> None:
    serve.run_rounds(tmp_path, requests=None, output_len=8, rounds=1, with_vllm=True, levels=[8],
                     engine_cores=("process", "inprocess"), max_num_batched_tokens=budget)


def test_parse_args_takes_the_budget():
    assert serve.parse_args([FLAG, "512"]).max_num_batched_tokens == 512
    assert serve.parse_args([]).max_num_batched_tokens is None  # each side's own default


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_budget_below_one_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args([FLAG, value])
    assert exit_info.value.code == 2
    assert f"argument {FLAG}:" in capsys.readouterr().err


def test_main_hands_the_budget_to_run_rounds(monkeypatch, tmp_path):
    seen, signature = {}, inspect.signature(serve.run_rounds)

    def run_rounds(*args, **kwargs):
        seen.update(signature.bind(*args, **kwargs).arguments)
        return {}

    monkeypatch.setattr(sys, "argv", ["serve.py", "--quick", FLAG, "96"])
    monkeypatch.setattr(serve, "tiny_model_dir", lambda directory: directory)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: None)
    monkeypatch.setattr(serve, "run_rounds", run_rounds)
    monkeypatch.setattr(serve, "report", lambda res, name: None)
    assert serve.main()["workload"]["max_num_batched_tokens"] == 96
    assert seen["max_num_batched_tokens"] == 96


def test_every_side_gets_the_budget(launched, tmp_path):
    run_rounds_with(512, tmp_path)
    assert [call.get("max_num_batched_tokens") for call in RecordedLLM.calls] == [512]  # offline
    assert set(launched) == {"kvpage serve", "kvpage serve in-process core", "vllm serve"}
    for name in ("kvpage serve", "kvpage serve in-process core"):
        argv = launched[name]
        assert argv[1:3] == ["-m", "kvpage"] and flag_values(argv) == ["512"]
        assert engine_kwargs(kvpage_parser().parse_args(argv[3:]))["max_num_batched_tokens"] == 512
    assert flag_values(launched["vllm serve"]) == ["512"]


def test_without_the_flag_every_side_keeps_its_own_default(launched, tmp_path):
    run_rounds_with(None, tmp_path)
    assert "max_num_batched_tokens" not in RecordedLLM.calls[0]  # LLM's own default
    argv = launched["kvpage serve"]
    assert flag_values(argv) == []
    assert engine_kwargs(kvpage_parser().parse_args(argv[3:]))["max_num_batched_tokens"] == \
        SERVE_DEFAULTS["max_num_batched_tokens"]
    assert flag_values(launched["vllm serve"]) == [str(VLLM_DEFAULT)]  # VllmPeer's, as bench/engine.py runs it
