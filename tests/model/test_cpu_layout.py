"""Column-major Linear weights: same values and outputs, only strides change; tied weights stay tied."""
import torch

from kvpage.model.cpu_layout import use_column_major_linear_weights

from tiny_models import random_prompts, tiny_model


def test_layout_changes_strides_not_outputs():
    model = tiny_model("llama", tie_word_embeddings=True)
    ids = torch.tensor(random_prompts([12])[0]).unsqueeze(0)
    with torch.inference_mode():
        before = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert use_column_major_linear_weights(model) == len(linears)
    for m in linears:
        assert m.weight.t().is_contiguous() and not m.weight.is_contiguous()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one shared Parameter
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert use_column_major_linear_weights(model) == 0  # idempotent
