"""Prepacked Linear weights (kvpage's slabs with q/k/v and gate/up fused, or MKL's): same outputs,
weights and tied parameters untouched, copies of the model unaffected."""
import copy

import pytest
import torch

from kvpage.model import cpu_layout
from kvpage.model.cpu_layout import prepack_linear_weights
from kvpage.ops import reference
from tiny_models import needs_slab_kernels, random_prompts, tiny_model

PACKINGS = [pytest.param("slabs", marks=needs_slab_kernels),
            pytest.param("mkl", marks=pytest.mark.skipif(not cpu_layout.mkl_packing_available(),
                                                          reason="torch built without MKL"))]


@pytest.fixture
def packing(request, monkeypatch):
    monkeypatch.setattr(cpu_layout, "slab_kernel_available", lambda: request.param == "slabs")
    return request.param


@pytest.mark.parametrize("packing", PACKINGS, indirect=True)
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_packed_linears_keep_outputs_and_weights(packing, family):
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


@pytest.mark.parametrize("packing", PACKINGS[:1], indirect=True)
def test_fused_siblings_each_return_their_own_projection(packing):
    """q/k/v share one packed matrix; each member still answers for its own weight, whether called
    with the tensor its sibling just saw, with another one, or with a prefill's many rows."""
    attn = tiny_model("qwen2").model.layers[0].self_attn
    prepack_linear_weights(attn)
    assert cpu_layout._SLABS[attn.q_proj][0] is cpu_layout._SLABS[attn.v_proj][0]
    with torch.inference_mode():
        for rows in (3, 300):  # 300: more than one of the kernel's 128-row blocks
            x, other = torch.randn(1, rows, attn.q_proj.in_features), torch.randn(rows, attn.q_proj.in_features)
            for proj, inp in ((attn.q_proj, x), (attn.k_proj, x), (attn.v_proj, other), (attn.k_proj, other)):
                expected = reference.linear(inp, proj.weight, proj.bias)
                torch.testing.assert_close(proj(inp), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packing", PACKINGS[:1], indirect=True)
def test_fused_output_is_computed_once_and_let_go_after_the_last_sibling(packing, monkeypatch):
    """q, k and v on one input: one packed call, and once v has its slice the matrix keeps no output
    (a prefill's outputs must not stay alive in every layer)."""
    attn = tiny_model("qwen2").model.layers[0].self_attn
    prepack_linear_weights(attn)
    fused = cpu_layout._SLABS[attn.q_proj][0]
    calls = []
    compute = fused.compute
    monkeypatch.setattr(fused, "compute", lambda x: calls.append(x) or compute(x))
    x = torch.randn(1, 5, attn.q_proj.in_features)
    with torch.inference_mode():
        outputs = [proj(x) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert len(calls) == 1
    assert fused.last_output is None and fused.last_input is None
    for proj, out in zip((attn.q_proj, attn.k_proj, attn.v_proj), outputs):
        torch.testing.assert_close(out, reference.linear(x, proj.weight, proj.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packing", PACKINGS[:1], indirect=True)
def test_every_packed_matrix_lives_in_one_huge_page_aligned_buffer(packing):
    """The model's packed matrices are consecutive views of one buffer on a 2 MiB boundary, each what
    packing its (fused) weight alone gives."""
    from kvpage.ops import huge_pages, layers

    model = tiny_model("qwen2")
    prepack_linear_weights(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = cpu_layout._SLABS[attn.q_proj][0], cpu_layout._SLABS[mlp.gate_proj][0]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    fused = {id(f): f for f, _ in (cpu_layout._SLABS[m] for m in linears)}.values()
    bases = {f.packed.untyped_storage().data_ptr() for f in fused}
    assert len(bases) == 1 and min(f.packed.data_ptr() for f in fused) % huge_pages.HUGE_PAGE == 0
    expected_qkv = layers.pack_linear_weight(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(qkv.packed, expected_qkv)
    assert torch.equal(gate_up.packed, layers.pack_linear_weight(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
