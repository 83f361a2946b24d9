"""Fused RMSNorm / SiLU-MLP forwards: same outputs as the modules' own code; a look-alike whose
formula differs keeps its forward (the probe rejects it)."""
import pytest
import torch

from kvpage.model.fused_layers import fuse_small_layers
from tiny_models import random_prompts, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_forwards_keep_the_logits(family):
    model = tiny_model(family)
    ids = torch.tensor(random_prompts([16])[0]).unsqueeze(0)
    with torch.inference_mode():
        before = model(ids).logits
    layers = model.config.num_hidden_layers
    assert fuse_small_layers(model) == 3 * layers + 1  # two norms and an MLP per layer, the final norm
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert fuse_small_layers(model) == 0  # already swapped


class GemmaLikeRMSNorm(torch.nn.Module):
    """Looks like Llama's RMSNorm but scales by (1 + weight)."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_a_different_formula_is_left_alone():
    model = torch.nn.Sequential(GemmaLikeRMSNorm(32))
    assert fuse_small_layers(model) == 0
    assert "forward" not in vars(model[0])
