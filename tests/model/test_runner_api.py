"""ModelRunner's contract: logits only for sampled rows, which kernel a step uses, sizing, bad input."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvpage import ops
from kvpage.model import (AttentionMetadata, ModelInput, ModelRunner, SequenceInput, kv_cache_bytes_per_block,
                          kvpage_attention_forward, num_blocks_for_memory, set_forward_context)
from kvpage.model.attention import HFForward
from kvpage.model.cpu_layout import slab_kernel_available
from kvpage.model.llama import LlamaForward
from tiny_models import model_pair, random_prompts, tiny_model

BLOCK = 8


def prefill_input(prompts, do_sample=True):
    """Each prompt in its own fresh blocks: prompt i gets blocks [4i, 4i + 4)."""
    seqs = []
    for i, prompt in enumerate(prompts):
        table = list(range(4 * i, 4 * i + 4))
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt))]
        seqs.append(SequenceInput(prompt, 0, table, slots, do_sample=do_sample))
    return ModelInput(seqs)


@pytest.mark.parametrize("generic", [False, True])  # kvpage's own forward, or HF's modules
def test_logits_only_for_sampled_rows_match_hf_forward(generic, monkeypatch):
    reference, model = model_pair("llama")
    if generic:
        monkeypatch.setattr("kvpage.model.runner.llama_family_mismatch", lambda config: "the generic path")
    runner = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    assert isinstance(runner.forward, HFForward if generic else LlamaForward)
    prompts = random_prompts([7, 12, 3])
    batch = prefill_input(prompts)
    batch.scheduled[1].do_sample = False  # a prefill chunk that ends mid-prompt samples nothing
    rows = []
    compute_logits = type(runner.forward).compute_logits
    monkeypatch.setattr(type(runner.forward), "compute_logits",
                        lambda self, hidden: rows.append(hidden.shape[0]) or compute_logits(self, hidden))
    logits = runner.execute(batch)
    assert rows == [2] and logits.shape == (2, model.config.vocab_size) and logits.dtype == torch.float32
    with torch.no_grad():
        want = [reference(torch.tensor([p])).logits[0, -1] for p in (prompts[0], prompts[2])]
    torch.testing.assert_close(logits, torch.stack(want), atol=1e-4, rtol=1e-4)


def _attention_kernels(runner, batch) -> list[str]:
    """The attention kernels one step ran, by name, as torch.profiler records them (the fused decoder
    layer op records each kernel it calls under the kernel's op name)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.execute(batch)
    names = ("kvpage::paged_attention", "kvpage::paged_prefill_attention")
    return [e.name for e in prof.events() if e.name in names]


@pytest.mark.parametrize("backend", ["slabs", "torch", "generic"])
def test_decode_steps_use_the_decode_kernel(backend, monkeypatch):
    """Whichever forward runs (the fused C++ layer, composed torch ops, HF's modules with the kvpage
    attention function), a prefill step runs the varlen kernel and a decode step the decode kernel."""
    if backend == "slabs" and not slab_kernel_available():
        pytest.skip(f"no slab kernels on CPU ISA {ops.cpu_isa()!r}")
    if backend == "torch":
        monkeypatch.setattr("kvpage.model.llama.slab_kernel_available", lambda: False)
    if backend == "generic":
        monkeypatch.setattr("kvpage.model.runner.llama_family_mismatch", lambda config: "the generic path")
    _, model = model_pair("qwen2")
    runner = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    prompts = random_prompts([5, 9])
    layers = model.config.num_hidden_layers
    assert _attention_kernels(runner, prefill_input(prompts)) == ["kvpage::paged_prefill_attention"] * layers
    decode = [SequenceInput([3], len(p), list(range(4 * i, 4 * i + 4)), [4 * i * BLOCK + len(p)])
              for i, p in enumerate(prompts)]
    assert _attention_kernels(runner, ModelInput(decode)) == ["kvpage::paged_attention"] * layers


def test_empty_step_only_moves_blocks():
    _, model = model_pair("llama")
    runner = ModelRunner(model, num_kv_blocks=8, block_size=BLOCK, num_host_blocks=4)
    runner.kv_caches[1][0][2] = 1.5
    assert runner.execute(ModelInput(blocks_to_swap_out=[(2, 3)])).shape == (0, model.config.vocab_size)
    assert bool((runner.host_kv_caches[1][0][3] == 1.5).all())
    runner.execute(ModelInput(blocks_to_copy=[(2, 5)]))
    assert bool((runner.kv_caches[1][0][5] == 1.5).all())


def test_cache_sizing():
    config = tiny_model("llama").config  # 2 layers, 2 KV heads, head_dim 16
    per_block = 2 * 2 * 2 * BLOCK * 16 * 4
    assert kv_cache_bytes_per_block(config, BLOCK, torch.float32) == per_block
    assert num_blocks_for_memory(config, 1.0, BLOCK, torch.float32) == 2**30 // per_block
    runner = ModelRunner(tiny_model("llama"), num_kv_blocks=3, block_size=BLOCK)
    assert runner.kv_cache_bytes_per_block() == per_block
    assert runner.kv_caches[0][0].shape == (3, 2, BLOCK, 16) and len(runner.kv_caches) == 2


def test_head_size_not_multiple_of_16_fails_at_construction():
    model = tiny_model("llama", head_dim=8)
    with pytest.raises(ValueError, match="head_size to be a multiple of 16.*head_dim is 8"):
        ModelRunner(model, num_kv_blocks=4, block_size=BLOCK)


def test_dtype_must_match_the_model():
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(tiny_model("llama"), num_kv_blocks=4, block_size=BLOCK, dtype=torch.bfloat16)


def test_bad_steps_raise_clear_errors():
    runner = ModelRunner(tiny_model("llama"), num_kv_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="one slot per token"):
        runner.execute(ModelInput([SequenceInput([1, 2], 0, [0], [0])]))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(ModelInput([SequenceInput([1] * 9, 0, [0], list(range(9)))]))
    with pytest.raises(ValueError, match="num_host_blocks"):
        runner.execute(ModelInput(blocks_to_swap_in=[(0, 1)]))


def test_attention_outside_a_step_raises():
    model = ModelRunner(tiny_model("llama"), num_kv_blocks=4, block_size=BLOCK).model
    with pytest.raises(RuntimeError, match="outside a kvpage step"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("kwargs,match", [(dict(position_bias=torch.zeros(1, 2, 3, 3)), "position_bias"),
                                          (dict(is_causal=False), "causal only")])
def test_attention_refuses_what_the_kernels_do_not_compute(kwargs, match):
    """T5-style position bias, a bidirectional layer: ignoring them would silently differ."""
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 2, 3, 16)
    metadata = AttentionMetadata.build([3], [3], [[0]], [0, 1, 2])
    with set_forward_context(metadata, [ops.allocate_kv_cache(1, BLOCK, 2, 16)]):
        with pytest.raises(NotImplementedError, match=match):
            kvpage_attention_forward(module, q, q, q, None, **kwargs)
        module.is_causal = False  # an encoder's layer says so itself (sdpa reads the same attribute)
        with pytest.raises(NotImplementedError, match="causal only"):
            kvpage_attention_forward(module, q, q, q, None)


def test_runs_a_scheduler_output_as_it_is():
    from kvpage.core import ScheduledSequence, SchedulerOutput

    _, model = model_pair("llama")
    runner = ModelRunner(model, num_kv_blocks=16, block_size=BLOCK)
    prompts = random_prompts([7, 12])
    ours = prefill_input(prompts)
    step = SchedulerOutput(step=0, scheduled=[
        ScheduledSequence(str(i), i, s.start, len(s.token_ids), s.token_ids, s.block_table, s.slot_mapping,
                          is_prefill=True, do_sample=True, num_samples=1) for i, s in enumerate(ours.scheduled)])
    torch.testing.assert_close(runner.execute(step), runner.execute(ours))


def test_metadata_build_lays_out_the_step_as_the_runner_payload_does():
    """AttentionMetadata.build (the HF cache's path) and the runner's step payload build the same fields
    in the same dtypes from the same sequences: tables padded with 0, query_start_loc the running sum."""
    from kvpage.model.step_inputs import pack_payload, unpack_payload

    seqs = [SequenceInput([5, 6, 7], 0, [4], [16, 17, 18]), SequenceInput([9], 9, [1, 2, 7], [29])]
    meta = AttentionMetadata.build([3, 1], [3, 10], [[4], [1, 2, 7]], [16, 17, 18, 29])
    step = unpack_payload(*pack_payload(ModelInput(seqs), BLOCK), torch.device("cpu"))
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        got, want = getattr(meta, name), getattr(step.metadata, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert meta.block_tables.tolist() == [[4, 0, 0], [1, 2, 7]] and meta.query_start_loc.tolist() == [0, 3, 4]
    assert (meta.max_query_len, meta.max_seq_len) == (step.metadata.max_query_len, step.metadata.max_seq_len) == (3, 10)
