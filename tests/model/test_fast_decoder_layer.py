"""The lean CPU decoder-layer forward: bit-identical to the module path through HF's code on prefill
and decode steps, used for every layer of a Llama / Qwen2 model, and out of the way elsewhere."""
import pytest
import torch

from kvpage.model import ModelInput, ModelRunner, SequenceInput
from kvpage.model import fast_decoder_layer
from kvpage.model.cpu_layout import prepack_linear_weights
from kvpage.model.fused_layers import fuse_small_layers
from kvpage.model.loader import set_kvpage_attention
from test_runner_api import BLOCK, prefill_input
from tiny_models import model_pair, needs_slab_kernels, random_prompts


def _two_steps(runner, prompts):
    """A prefill of every prompt, then one decode step each."""
    first = runner.execute(prefill_input(prompts))
    decode = [SequenceInput([int(first[i].argmax())], len(p), list(range(4 * i, 4 * i + 4)),
                            [4 * i * BLOCK + len(p)]) for i, p in enumerate(prompts)]
    return first, runner.execute(ModelInput(decode))


@needs_slab_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_lean_layers_match_the_module_path_bitwise(family, monkeypatch):
    prompts = random_prompts([7, 12, 3])
    _, model = model_pair(family)
    fast = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    assert all("forward" in vars(layer) for layer in model.model.layers)
    fast_logits = _two_steps(fast, prompts)
    monkeypatch.setattr(fast_decoder_layer, "install_fast_decoder_layers", lambda model: 0)
    monkeypatch.setattr("kvpage.model.runner.install_fast_decoder_layers", lambda model: 0)
    _, plain_model = model_pair(family)
    plain = ModelRunner(plain_model, num_kv_blocks=16, block_size=BLOCK)
    assert not any("forward" in vars(layer) for layer in plain_model.model.layers)
    for a, b in zip(fast_logits, _two_steps(plain, prompts)):
        assert torch.equal(a, b)


def test_outside_a_step_the_layer_runs_its_own_code():
    reference, model = model_pair("llama")
    ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    model.config._attn_implementation = "sdpa"  # plain HF forward, no kvpage step around it
    ids = torch.tensor([random_prompts([9])[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


@needs_slab_kernels
def test_a_layer_of_another_shape_is_left_alone():
    _, model = model_pair("llama")
    layer = model.model.layers[0]
    layer.extra_norm = torch.nn.LayerNorm(model.config.hidden_size)  # not a plain pre-norm Llama layer
    ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    assert "forward" not in vars(layer) and "forward" in vars(model.model.layers[1])


@needs_slab_kernels
def test_a_layer_without_separate_projections_is_left_alone():
    """Same children, but one projection missing (a fused qkv_proj family): checked, not installed."""
    _, model = model_pair("llama")
    layer = model.model.layers[0]
    layer.self_attn.qkv_proj = layer.self_attn.v_proj
    del layer.self_attn.v_proj
    assert fast_decoder_layer.install_fast_decoder_layers(model) == 0  # nothing packed: nothing qualifies
    set_kvpage_attention(model)
    prepack_linear_weights(model)
    fuse_small_layers(model)
    assert fast_decoder_layer.install_fast_decoder_layers(model) == model.config.num_hidden_layers - 1
    assert "forward" not in vars(layer)


def test_a_deepcopy_runs_the_module_path():
    """The packed weights stay with the original; a copy's layers fall back to HF's code."""
    import copy
    prompts = random_prompts([7, 12])
    _, model = model_pair("llama")
    runner = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    twin = ModelRunner(copy.deepcopy(model), num_kv_blocks=16, block_size=BLOCK)
    for a, b in zip(_two_steps(runner, prompts), _two_steps(twin, prompts)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_without_slab_kernels_the_runner_keeps_hf_code(family, monkeypatch):
    """Where the slab GEMM cannot run (no AVX2 / AVX-512, or KVPAGE_CPU_ISA=generic), no layer or
    model forward is swapped, and the steps still compute HF's logits."""
    monkeypatch.setattr("kvpage.model.cpu_layout.slab_kernel_available", lambda: False)
    reference, model = model_pair(family)
    prompts = random_prompts([7, 12])
    runner = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    assert runner._lean is None and not any("forward" in vars(layer) for layer in model.model.layers)
    logits = runner.execute(prefill_input(prompts))
    with torch.no_grad():
        want = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
