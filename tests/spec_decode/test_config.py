"""speculative_config: vLLM's keys, each bad value refused by name (before any model loads), and the
command line's --speculative-config (serve and generate, from the option's one declaration)."""
from __future__ import annotations

import argparse

import pytest

import kvpage
from kvpage.engine.arg_utils import OPTIONS, add_engine_args, engine_kwargs
from kvpage.spec_decode import SpeculativeConfig, parse_speculative_config


def test_ngram_config_and_defaults():
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert c == SpeculativeConfig("ngram", 3, 1, 4)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,'
                                 ' "prompt_lookup_max": 6}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (5, 2, 6)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("config, names", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 1}, "num_lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ("{not json", "JSON"),
    ([1, 2], "dict"),
])
def test_bad_config_names_the_key(config, names):
    with pytest.raises(ValueError, match=names):
        parse_speculative_config(config)


def test_llm_refuses_a_bad_config_by_name_before_loading():
    # A model path that does not exist: the config's error must come first (checked before loading).
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        kvpage.LLM(model="/nonexistent", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                             "prompt_lookup_max": 0})


def test_draft_model_path_refused_by_name():
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]"):
        from kvpage.spec_decode.draft_model import load_draft_model
        load_draft_model("/nonexistent/draft", 1000)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_command_line_flag(command):
    """--speculative-config comes from the option's one declaration, as JSON, checked at parse time."""
    from kvpage.cli import build_parser
    parser = build_parser()
    base = [command] if command == "serve" else [command, "hi"]
    args = parser.parse_args(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_kwargs(parser.parse_args(base))["speculative_config"] is None


def test_command_line_flag_refuses_a_bad_key(capsys):
    parser = argparse.ArgumentParser(prog="kvpage serve")
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "k": 1}'])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "'k'" in err
    assert OPTIONS["speculative_config"].default is None
