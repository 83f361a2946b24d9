"""The model's generation_config.json sampling defaults (vLLM's generation_config="auto"): LLM.generate / chat
without SamplingParams and the server's requests take them where they leave a field out."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import kvpage
from kvpage.engine.generation_defaults import EMBEDDED_MODEL_DEFAULTS, fill_defaults, model_sampling_defaults
from kvpage.server.protocol import CompletionRequest
from kvpage.server.serving import sampling_params

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # tests/server's helpers (a rootdir-less import)
from server_helpers import MODEL_NAME, post, running_server  # noqa: E402

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def recommending_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation_config.json that recommends sampling settings (as Qwen's, Llama's do)."""
    path = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **RECOMMENDED, "do_sample": True}))
    return path


@pytest.fixture(scope="module")
def llm(recommending_model_dir):
    llm = kvpage.LLM(model=str(recommending_model_dir), num_kv_blocks=64)
    yield llm
    llm.shutdown()


def test_llm_reads_the_models_defaults(llm):
    assert llm.default_sampling_fields == RECOMMENDED
    assert llm.get_default_sampling_params() == kvpage.SamplingParams(**RECOMMENDED)


def test_generate_and_chat_without_params_use_them(llm, monkeypatch):
    seen, add = [], llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request", lambda rid, prompt, params, **kw: seen.append(params) or
                        add(rid, prompt, params, **kw))
    llm.generate("Hello", use_tqdm=False)
    llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    llm.generate("Hello", kvpage.SamplingParams(max_tokens=2), use_tqdm=False)  # given: used as is
    assert [p.temperature for p in seen] == [0.6, 0.6, 1.0] and seen[0].top_k == 20


def test_a_request_overrides_each_default_it_sets(llm):
    defaults = llm.default_sampling_fields
    left_out = sampling_params(CompletionRequest(prompt="hi"), 16, None, defaults=defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    set_ = sampling_params(CompletionRequest(prompt="hi", temperature=1.0, top_k=0), 16, None, defaults=defaults)
    assert (set_.temperature, set_.top_k, set_.top_p) == (1.0, 0, 0.95)


def test_the_server_answers_a_request_without_temperature_at_the_models(tiny_model_dir, tmp_path):
    """A model recommending temperature 0: a request that leaves it out gets the greedy answer."""
    path = tmp_path / "greedy"
    shutil.copytree(tiny_model_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    llm = kvpage.LLM(model=str(path), num_kv_blocks=64)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "seed": 1}
    try:
        with running_server(llm) as (url, _):
            answers = [post(f"{url}/v1/completions", {**body, **extra})[1]["choices"][0]["text"]
                       for extra in ({}, {"temperature": 0}, {"temperature": 1.0})]
    finally:
        llm.shutdown()
    assert answers[0] == answers[1] != answers[2]


def test_the_embedded_model_gets_its_model_cards_recommendation():
    """Its GGUF-converted generation_config.json recommends nothing; a file that does wins field by field."""
    class Converted:
        name_or_path = ""
        generation_config = None

    assert model_sampling_defaults(Converted(), embedded=True) == EMBEDDED_MODEL_DEFAULTS
    assert model_sampling_defaults(Converted()) == {}
    assert fill_defaults({"temperature": None, "top_p": 0.5}, {"temperature": 0.2, "top_p": 0.9}) == \
        {"temperature": 0.2, "top_p": 0.5}
