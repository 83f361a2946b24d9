"""The lean base-model forward (kvpage.model.lean_forward): used where every decoder layer runs the
fused op, bit-identical to HF's model forward on prefill and decode steps, and out of the way where
the model's forward does anything it does not."""
import pytest
import torch

from kvpage.model import ModelRunner
from test_fast_decoder_layer import _two_steps
from test_runner_api import BLOCK
from tiny_models import model_pair, needs_slab_kernels, random_prompts


@needs_slab_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_lean_forward_matches_hf_model_forward_bitwise(family, monkeypatch):
    prompts = random_prompts([7, 12, 3])
    _, model = model_pair(family)
    lean = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    assert lean._lean is not None
    lean_logits = _two_steps(lean, prompts)
    monkeypatch.setattr("kvpage.model.runner.lean_forward_for", lambda model: None)
    _, plain_model = model_pair(family)
    plain = ModelRunner(plain_model, num_kv_blocks=16, block_size=BLOCK)
    assert plain._lean is None
    for a, b in zip(lean_logits, _two_steps(plain, prompts)):
        assert torch.equal(a, b)


@needs_slab_kernels
def test_a_layer_left_to_its_own_code_keeps_hf_model_forward():
    _, model = model_pair("llama")
    model.model.layers[1].extra_norm = torch.nn.LayerNorm(model.config.hidden_size)  # no fused op for it
    runner = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    assert runner._lean is None and "forward" in vars(model.model.layers[0])


def test_a_base_model_whose_forward_does_more_keeps_it(monkeypatch):
    """A family whose model forward adds a step the lean forward does not know (here: scaled final
    states) fails the probe and keeps its own forward, so the step still computes what HF does."""
    def scaled(model):
        class Scaled(type(model.model)):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                out.last_hidden_state = out.last_hidden_state * 0.5
                return out
        model.model.__class__ = Scaled
        return model

    prompts = random_prompts([6, 9])
    runner = ModelRunner(scaled(model_pair("llama")[1]), num_kv_blocks=16, block_size=BLOCK)
    assert runner._lean is None
    monkeypatch.setattr("kvpage.model.runner.install_fast_decoder_layers", lambda model: 0)
    plain = ModelRunner(scaled(model_pair("llama")[1]), num_kv_blocks=16, block_size=BLOCK)
    for a, b in zip(_two_steps(runner, prompts), _two_steps(plain, prompts)):
        assert torch.equal(a, b)
