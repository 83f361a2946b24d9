"""MKL-prepacked Linear weights: same outputs, weights and tied parameters untouched."""
import copy

import pytest
import torch

from kvpage.model.cpu_layout import mkl_packing_available, prepack_linear_weights
from tiny_models import random_prompts, tiny_model


@pytest.mark.skipif(not mkl_packing_available(), reason="torch built without MKL: nothing is packed")
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_packed_linears_keep_outputs_and_weights(family):
    model = tiny_model(family, tie_word_embeddings=True)
    ids = torch.tensor(random_prompts([12, 40])[1]).unsqueeze(0)
    with torch.inference_mode():
        before = model(ids).logits
    weights = {n: p.clone() for n, p in model.named_parameters()}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert prepack_linear_weights(model) == len(linears)
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one shared Parameter
    assert prepack_linear_weights(model) == 0  # idempotent
    twin = copy.deepcopy(model)  # the packed copies stay behind; the twin computes with F.linear
    with torch.inference_mode():
        torch.testing.assert_close(twin(ids).logits, before, rtol=1e-5, atol=1e-5)
