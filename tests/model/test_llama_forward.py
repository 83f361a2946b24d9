"""kvpage's own forward for Llama-family decoders (kvpage.model.llama): its hidden states and logits
against HF's own forward (eager attention over HF's dense cache) on a packed prefill and a decode
step, for each backend; its rotary tables against HF's bit for bit; the config deciding which models
it takes; and the HF model left untouched."""
import pytest
import torch
from transformers import GemmaConfig, LlamaConfig, Qwen2Config

from kvpage import ops
from kvpage.model import AttentionMetadata, ModelRunner, set_kvpage_attention
from kvpage.model.attention import HFForward, head_dim_of
from kvpage.model.llama import DecoderLayer, FusedCpuLayer, LlamaForward, RotaryEmbedding, llama_family_mismatch
from test_runner_api import BLOCK
from tiny_models import VOCAB, needs_slab_kernels, random_prompts, tiny_model

FAMILIES = ["llama", "qwen2", "mistral"]  # qwen2: q/k/v biases and head_dim 32
BACKENDS = [pytest.param("fused", marks=needs_slab_kernels), pytest.param("composed-slabs", marks=needs_slab_kernels),
            "torch", "bf16"]


def _build(family: str, backend: str, monkeypatch):
    """(HF reference on eager attention, kvpage's forward built from the same model)."""
    model = tiny_model(family)
    if backend == "bf16":
        model = model.to(torch.bfloat16)
    if backend in ("torch", "bf16"):
        monkeypatch.setattr("kvpage.model.llama.slab_kernel_available", lambda: False)
    model.set_attn_implementation("eager")
    forward = LlamaForward.build(model, fused_cpu_layers=backend == "fused")
    kinds = {"fused": FusedCpuLayer}.get(backend, DecoderLayer)
    assert all(type(layer) is kinds for layer in forward.layers)
    return model, forward


def _caches(model, dtype):
    config = model.config
    return [ops.allocate_kv_cache(32, BLOCK, config.num_key_value_heads, head_dim_of(config), dtype=dtype)
            for _ in range(config.num_hidden_layers)]


def _tables(prompts):
    """Prompt i in blocks [8i, 8i + 8)."""
    return [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]


def _assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _assert_near(got, want):
    """bf16: kvpage's attention sums in fp32 where eager rounds to bf16 between its ops, so single
    elements differ by bf16 steps (2^-8 relative); the whole stays within 3% (the next tests hold the bf16 backend to
    HF's own modules bit for bit)."""
    assert (got.float() - want.float()).norm() <= 3e-2 * want.float().norm()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_hf_eager_forward(family, backend, monkeypatch):
    model, forward = _build(family, backend, monkeypatch)
    close = _assert_near if backend == "bf16" else _assert_close
    prompts, tables = random_prompts([7, 12, 3]), _tables([7, 12, 3])
    caches = _caches(model, model.dtype)
    lens = [len(p) for p in prompts]
    slots = [t[j // BLOCK] * BLOCK + j % BLOCK for p, t in zip(prompts, tables) for j in range(len(p))]
    with torch.inference_mode():
        prefill = AttentionMetadata.build(lens, lens, tables, slots)
        hidden = forward(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in lens]), prefill, caches)
        hf = [model(torch.tensor([p]), use_cache=True, output_hidden_states=True) for p in prompts]
        # HF's last hidden_states entry is after the final norm, as the forward's output.
        close(hidden, torch.cat([out.hidden_states[-1][0] for out in hf]))
        last = hidden[torch.tensor(lens).cumsum(0) - 1]
        close(forward.compute_logits(last), torch.stack([out.logits[0, -1] for out in hf]))

        tokens = [int(out.logits[0, -1].argmax()) for out in hf]
        decode = AttentionMetadata.build([1] * len(prompts), [n + 1 for n in lens], tables,
                                         [t[n // BLOCK] * BLOCK + n % BLOCK for t, n in zip(tables, lens)])
        hidden = forward(torch.tensor(tokens), torch.tensor(lens), decode, caches)
        want = [model(torch.tensor([[tok]]), cache=out.past_key_values).logits[0, -1] for tok, out in zip(tokens, hf)]
        close(forward.compute_logits(hidden), torch.stack(want))


def _packed_prefill(forward, model, prompts, dtype=torch.float32):
    """Hidden states of one prefill step of `prompts` through `forward`, on fresh caches."""
    tables, lens = _tables(prompts), [len(p) for p in prompts]
    slots = [t[j // BLOCK] * BLOCK + j % BLOCK for p, t in zip(prompts, tables) for j in range(len(p))]
    with torch.inference_mode():
        return forward(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in lens]),
                       AttentionMetadata.build(lens, lens, tables, slots), _caches(model, dtype))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bf16_backend_is_hfs_modules_bit_for_bit(family, monkeypatch):
    """A bf16 model through the composed backend and through transformers' own modules (with the kvpage
    attention function): HF's arithmetic in HF's order, so the same bits."""
    monkeypatch.setattr("kvpage.model.llama.slab_kernel_available", lambda: False)
    model = tiny_model(family).to(torch.bfloat16)
    set_kvpage_attention(model)
    prompts = random_prompts([7, 12, 3])
    ours, hf = (_packed_prefill(f, model, prompts, torch.bfloat16) for f in (LlamaForward.build(model), HFForward(model)))
    assert torch.equal(ours, hf)


@needs_slab_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_cpu_layer_is_the_composed_layer_bit_for_bit(family):
    """The C++ decoder-layer op runs the composed backend's kernels in its order (what a tensor-parallel
    shard runs on a CPU): the same bits, prefill and decode."""
    model = tiny_model(family)
    fused, composed = (LlamaForward.build(model, fused_cpu_layers=f) for f in (True, False))
    prompts, tables = random_prompts([9, 20]), _tables([9, 20])
    outputs = []
    for forward in (fused, composed):
        caches = _caches(model, torch.float32)
        with torch.inference_mode():
            lens = [len(p) for p in prompts]
            slots = [t[j // BLOCK] * BLOCK + j % BLOCK for p, t in zip(prompts, tables) for j in range(len(p))]
            meta = AttentionMetadata.build(lens, lens, tables, slots)
            outputs.append(forward(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in lens]),
                                   meta, caches))
            meta = AttentionMetadata.build([1, 1], [n + 1 for n in lens], tables,
                                           [t[n // BLOCK] * BLOCK + n % BLOCK for t, n in zip(tables, lens)])
            outputs.append(forward(torch.tensor([5, 6]), torch.tensor(lens), meta, caches))
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}])
def test_rotary_tables_are_hfs_bit_for_bit(rope):
    overrides = {} if rope is None else {"rope_parameters": {"rope_theta": 10000.0, **rope}}
    model = tiny_model("llama", **overrides)
    assert llama_family_mismatch(model.config) is None
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 3])
    x = torch.zeros(1, len(positions), model.config.hidden_size)
    want_cos, want_sin = model.model.rotary_emb(x, positions[None])
    cos, sin = RotaryEmbedding(model.model.rotary_emb)(positions, torch.float32)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


@pytest.mark.parametrize("config,reason", [
    (GemmaConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, head_dim=16), "model_type 'gemma'"),
    (LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, hidden_act="gelu"), "hidden_act"),
    (LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                 rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "dynamic"),
])
def test_the_config_decides_which_models_take_the_owned_forward(config, reason):
    assert reason in llama_family_mismatch(config)


def test_sliding_window_llama_family_models_take_the_owned_forward():
    """Mistral's window and Qwen2's (use_sliding_window, from max_window_layers on) are each layer's own."""
    qwen2 = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                        use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert llama_family_mismatch(qwen2) is None
    forward = LlamaForward.build(tiny_model("mistral", sliding_window=4))
    assert [layer.sliding_window for layer in forward.layers] == [4, 4] and forward.sliding_window == 4


def test_other_models_run_hfs_modules():
    from transformers import GemmaForCausalLM
    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    runner = ModelRunner(GemmaForCausalLM(config).eval(), num_kv_blocks=8, block_size=BLOCK)
    assert isinstance(runner.forward, HFForward)


@pytest.mark.parametrize("family", FAMILIES)
def test_building_leaves_the_hf_model_as_it_was(family):
    """No forward, function or weight of transformers' modules changes: HF's own forward still
    computes what an untouched copy of the model does."""
    model, untouched = tiny_model(family), tiny_model(family)
    weights = {n: p.clone() for n, p in model.named_parameters()}
    ModelRunner(model, num_kv_blocks=8, block_size=BLOCK)
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([random_prompts([9])[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, untouched(ids).logits)
