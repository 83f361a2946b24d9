"""The fused rotary embedding inside kvpage steps: used there, HF's own function everywhere else, and
a module whose rotary formula differs keeps its own."""
import sys
import types

import pytest
import torch

from kvpage.model import ModelRunner
from kvpage.model.fast_rotary import FUNCTION_NAME, RotarySwap
from test_runner_api import prefill_input
from tiny_models import model_pair, random_prompts


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_runner_steps_use_the_fused_rotary_and_restore_hf(family, monkeypatch):
    # The module path (HF's attention code); the lean decoder layers call the rotary op themselves.
    monkeypatch.setattr("kvpage.model.runner.install_fast_decoder_layers", lambda model: 0)
    reference, model = model_pair(family)
    runner = ModelRunner(model, num_kv_blocks=16, block_size=8)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = getattr(modeling, FUNCTION_NAME)
    assert [m for m, _ in runner._rotary.swaps] == [modeling]
    seen = []
    fused = runner._rotary.swaps[0][1]
    runner._rotary.swaps[0] = (modeling, lambda *a, **k: seen.append(1) or fused(*a, **k))
    prompts = random_prompts([7, 12])
    logits = runner.execute(prefill_input(prompts))
    assert len(seen) == model.config.num_hidden_layers  # one call per layer, through the swap
    assert getattr(modeling, FUNCTION_NAME) is original  # HF's function is back after the step
    with torch.no_grad():
        want = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_fused_rotary_falls_back_outside_its_layout():
    _, model = model_pair("llama")
    fused = RotarySwap(model).swaps[0][1]
    original = fused.kvpage_original
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)  # batch 2: HF generate's layout
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    for a, b in zip(fused(q, k, cos, sin), original(q, k, cos, sin)):
        assert torch.equal(a, b)


def test_a_module_with_another_rotary_formula_is_left_alone(monkeypatch):
    _, model = model_pair("llama")
    interleaved = types.ModuleType("interleaved_modeling")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J style: pairs (2i, 2i + 1)
        def rotate(x):
            pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return x * cos.unsqueeze(unsqueeze_dim) + pairs * sin.unsqueeze(unsqueeze_dim)
        return rotate(q), rotate(k)

    interleaved.apply_rotary_pos_emb = apply_rotary_pos_emb
    monkeypatch.setitem(sys.modules, "interleaved_modeling", interleaved)
    for layer in model.model.layers:
        cls = type(layer.self_attn)
        layer.self_attn.__class__ = type(cls.__name__, (cls,), {"__module__": "interleaved_modeling"})
    assert RotarySwap(model).swaps == []
