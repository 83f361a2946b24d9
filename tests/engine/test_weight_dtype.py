"""LLM(weight_dtype="bfloat16" / "float16") for the float32 default model on CPU: every weight rounded
to 16 bits in place, the linears packed in 16 bits and computed in float32. The reference is HF
generate on those same (rounded) parameters, so greedy tokens must agree as between any two fp32
implementations."""
from __future__ import annotations

import copy

import pytest
import torch

import kvpage
from kvpage.model import cpu_layout
from kvpage.model.runner import check_matmul_precision, check_weight_dtype
from engine_helpers import GREEDY, PROMPTS, assert_greedy_matches, hf_generate, make_llm

STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_PROMPTS = PROMPTS[:6] + PROMPTS[11:14]


@pytest.fixture(scope="module", params=sorted(STORAGE))
def rounded(request, llm):
    """(weight_dtype name, an LLM with it on a freshly loaded default model, HF's greedy references on
    that model's rounded parameters)."""
    engine = kvpage.LLM(num_kv_blocks=1024, weight_dtype=request.param)
    hf = copy.deepcopy(engine.model)  # HF's own modules on the same rounded weights
    hf.set_attn_implementation("sdpa")
    ids = [engine.tokenizer.encode(p) for p in WEIGHT_PROMPTS]
    return request.param, engine, hf_generate(hf.eval(), ids, GREEDY.max_tokens)


def test_weights_are_rounded_and_linears_stored_in_16_bits(llm, rounded):
    name, engine, _ = rounded
    dtype = STORAGE[name]
    params = dict(engine.model.named_parameters())
    for param in params.values():
        assert param.dtype == torch.float32 and torch.equal(param, param.to(dtype).float())
    originals = dict(llm.model.named_parameters())
    assert any(not torch.equal(p, originals[n]) for n, p in params.items())  # rounding changed something
    slabs = engine.runner.forward.packed_weights()
    if cpu_layout.slab_kernel_available():  # every layer's 4 matrices and the LM head
        assert len(slabs) == 4 * engine.model.config.num_hidden_layers + 1
        assert all(packed.dtype == dtype for packed in slabs)
    else:  # no slab kernel (KVPAGE_CPU_ISA=generic): the linears multiply the rounded fp32 weights
        assert not slabs


def _sampled_logprobs(output) -> torch.Tensor:
    completion = output.outputs[0]
    return torch.tensor([d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids)])


def _reference_logprobs(ref) -> torch.Tensor:
    tokens, logits = ref
    return torch.tensor([torch.log_softmax(lg, -1)[t].item() for lg, t in zip(logits, tokens)])


def test_logprobs_are_those_of_the_rounded_weights(rounded, hf_greedy):
    """Greedy tokens rarely move under 16-bit rounding (they did not on these prompts), logprobs do: the
    engine's match HF's on the rounded weights, and stand clearly apart from the float32 model's."""
    _, engine, refs = rounded
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, logprobs=0)
    outputs = engine.generate(WEIGHT_PROMPTS, params, use_tqdm=False)
    full = [hf_greedy[PROMPTS.index(p)] for p in WEIGHT_PROMPTS]
    near, far = 0.0, 0.0
    for out, ref, ref32 in zip(outputs, refs, full):
        if out.outputs[0].token_ids != ref[0] or ref[0] != ref32[0]:
            continue  # compare where all three chose the same tokens
        got = _sampled_logprobs(out)
        near = max(near, (got - _reference_logprobs(ref)).abs().max().item())
        far = max(far, (got - _reference_logprobs(ref32)).abs().max().item())
    print(f"max |logprob - rounded reference| {near:.2e}, - float32 reference {far:.2e}")
    assert far > 0, "no prompt to compare"
    assert near < 5e-4 and far > 10 * near


@pytest.mark.parametrize("config", [{}, dict(enable_prefix_caching=False, max_num_batched_tokens=32)],
                         ids=["prefix_caching", "chunked_prefill"])
def test_greedy_matches_hf_on_the_rounded_weights(rounded, config):
    name, engine, refs = rounded
    outputs = make_llm(engine, **config).generate(WEIGHT_PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches(outputs, refs)


def test_bad_weight_dtype_names_the_argument(llm):
    with pytest.raises(ValueError, match="weight_dtype"):
        kvpage.LLM(model=llm.model, tokenizer=llm.tokenizer, weight_dtype="int8")
    with pytest.raises(ValueError, match="matmul_precision"):
        kvpage.LLM(model=llm.model, tokenizer=llm.tokenizer, matmul_precision="low")
    before = [p.clone() for p in llm.model.parameters()]
    with pytest.raises(ValueError, match="weight_dtype"):  # llm's forward packed them already, unrounded
        kvpage.LLM(model=llm.model, tokenizer=llm.tokenizer, num_kv_blocks=64, weight_dtype="bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(before, llm.model.parameters()))  # and nothing was rounded


@pytest.mark.parametrize("weight_dtype,dtype,device", [
    (torch.bfloat16, torch.bfloat16, "cpu"),  # 16-bit storage under float32 compute only
    (torch.float16, torch.float32, "cuda"),
    (torch.float8_e4m3fn, torch.float32, "cpu"),
])
def test_unsupported_pairings_name_weight_dtype(weight_dtype, dtype, device):
    with pytest.raises(ValueError, match="weight_dtype"):
        check_weight_dtype(weight_dtype, dtype, torch.device(device))


@pytest.mark.parametrize("dtype,device", [(torch.bfloat16, "cpu"), (torch.float32, "cuda")])
def test_medium_precision_needs_a_float32_model_on_cpu(dtype, device):
    with pytest.raises(ValueError, match="matmul_precision"):
        check_matmul_precision("medium", dtype, torch.device(device))
    check_matmul_precision("highest", dtype, torch.device(device))


def test_float16_refuses_weights_beyond_its_range():
    """A weight past 65504 would round to inf: refused by name, before any parameter is changed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpage.model import ModelRunner

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e5
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="weight_dtype float16.*down_proj"):
        ModelRunner(model, num_kv_blocks=4, weight_dtype=torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ModelRunner(model, num_kv_blocks=4, weight_dtype=torch.bfloat16)  # bf16 has float32's range
    assert model.model.layers[0].mlp.down_proj.weight[0, 0].item() == 99840.0  # 1e5 rounded to bf16


@pytest.fixture(scope="module")
def medium():
    """An LLM with bf16 weights and matmul_precision="medium", and HF's references on its rounded weights."""
    engine = kvpage.LLM(num_kv_blocks=1024, weight_dtype="bfloat16", matmul_precision="medium")
    hf = copy.deepcopy(engine.model)
    hf.set_attn_implementation("sdpa")
    ids = [engine.tokenizer.encode(p) for p in WEIGHT_PROMPTS]
    return engine, hf_generate(hf.eval(), ids, GREEDY.max_tokens)


def test_medium_precision_computes_in_bf16_close_to_the_rounded_weights(medium):
    """With AVX512-BF16 the linears round their inputs to bf16 too: logprobs move away from HF's on the
    rounded weights, about as far as rounding the weights moved them from float32's (3e-2; measured up
    to 4.5e-2), and greedy tokens agree but at near-ties (as with 16-bit KV caches). Elsewhere "medium"
    computes in float32: HF's, to fp32 noise."""
    from kvpage.ops.layers import bf16_dot_available

    engine, refs = medium
    slabs = engine.runner.forward.packed_weights()
    if cpu_layout.slab_kernel_available():
        assert slabs and all(packed.dim() == (4 if bf16_dot_available() else 3) for packed in slabs)
    else:  # no slab kernel (KVPAGE_CPU_ISA=generic): float32 products of the rounded weights
        assert not slabs and not bf16_dot_available()
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, logprobs=0)
    outputs = engine.generate(WEIGHT_PROMPTS, params, use_tqdm=False)
    gaps = []
    for out, ref in zip(outputs, refs):
        n = next((i for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref[0])) if a != b), len(ref[0]))
        if n:
            gaps.append((_sampled_logprobs(out)[:n] - _reference_logprobs(ref)[:n]).abs().max().item())
    print(f"max |logprob - rounded-weight reference| per prompt: {[f'{g:.1e}' for g in gaps]}")
    assert len(gaps) == len(refs)
    if bf16_dot_available():
        assert 1e-3 < max(gaps) < 0.1
        ties = assert_greedy_matches(outputs, refs, tie_tolerance=0.1)
        assert ties <= len(refs) // 2
    else:
        assert max(gaps) < 5e-4
        assert_greedy_matches(outputs, refs)
