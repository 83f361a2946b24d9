"""The engine options' one declaration (kvpage.engine.arg_utils): LLM(...) takes exactly these keywords with
these defaults, and every command that loads a model offers each as a flag with its help and default."""
from __future__ import annotations

import argparse
import inspect

import pytest

from kvpage import cli
from kvpage.engine.arg_utils import ENGINE_DEFAULTS, ENGINE_OPTIONS, OPTIONS, SERVE_DEFAULTS, engine_kwargs
from kvpage.engine.llm import LLM

# LLM keywords that are objects, not command-line values.
NOT_FLAGS = {"tokenizer"}


def test_llm_signature_is_the_declaration():
    params = inspect.signature(LLM.__init__).parameters
    declared = {name: p.default for name, p in params.items() if name not in ("self", *NOT_FLAGS)}
    assert declared == ENGINE_DEFAULTS


def _parser(command: str) -> argparse.ArgumentParser:
    action = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


@pytest.mark.parametrize("command", ["generate", "chat", "demo", "bench", "serve"])
def test_every_command_offers_every_engine_option(command):
    flags = {s for a in _parser(command)._actions for s in a.option_strings}
    # serve's MODEL is positional; the other commands' --seed is the sampling seed.
    skipped = {"serve": {"model"}}.get(command, {"seed"})
    missing = [o.flag for o in ENGINE_OPTIONS if o.name not in skipped and o.flag not in flags]
    assert not missing


def test_flags_reach_llm_by_name():
    args = cli.build_parser().parse_args(["serve", "--block-size", "32", "--no-enable-prefix-caching",
                                          "--max-num-seqs", "4", "--kv-cache-dtype", "fp8"])
    defaults = {name: value for name, value in ENGINE_DEFAULTS.items() if name != "model"}  # serve's is positional
    defaults.update(SERVE_DEFAULTS)
    assert engine_kwargs(args) == {**defaults, "block_size": 32, "enable_prefix_caching": False, "max_num_seqs": 4,
                                   "kv_cache_dtype": "fp8"}
    generate = engine_kwargs(cli.build_parser().parse_args(["generate", "hi", "--seed", "7"]))
    assert "seed" not in generate and generate["model"] is None  # --seed is SamplingParams'


def test_serve_has_its_own_defaults_and_shows_them():
    """SERVE_DEFAULTS reach `kvpage serve`'s engine and its --help; the other commands and LLM(...) keep the
    engine's own (None: the offline fallback)."""
    serve, generate = _parser("serve"), _parser("generate")
    for name, value in SERVE_DEFAULTS.items():
        assert value != ENGINE_DEFAULTS[name]
        assert engine_kwargs(serve.parse_args([]))[name] == value
        assert engine_kwargs(generate.parse_args(["hi"]))[name] == ENGINE_DEFAULTS[name]
        flag = next(action for action in serve._actions if action.dest == name)
        assert flag.help.endswith(f"(default: {value})") and f"(default: {value})" in serve.format_help()
        assert getattr(serve.parse_args([OPTIONS[name].flag, "64"]), name) == 64
