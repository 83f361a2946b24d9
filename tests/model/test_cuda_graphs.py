"""Decode steps through CUDA graphs: the buckets, and the padded persistent buffers a graph reads.

On a CPU no graph can be captured, so DecodeGraphs(capture=False) runs the forward eagerly over the
same padded buffers: a decode step through them must give the unpadded step's hidden states, whatever
bucket it lands in. On a GPU the captured graph must give the eager step's logits (skipped without CUDA;
bench/gpu_check.sh runs it on the lent GPU).
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpage.model import ModelRunner
from kvpage.model.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes
from kvpage.model.metadata import AttentionMetadata


def test_capture_sizes_follow_vllm():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize("n, expected", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 20), (20, 20), (21, None)])
def test_bucket_is_the_smallest_size_that_holds_the_batch(n, expected):
    assert bucket_for(n, capture_sizes(20)) == expected


def _runner(device="cpu"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval().to(device)
    return ModelRunner(model, num_kv_blocks=64, block_size=4)


def _decode_step(runner, lengths, seed=0):
    """Fills the cache with random K/V context by a prefill, then returns one decode step's inputs."""
    g = torch.Generator().manual_seed(seed)
    tables, start = [], 1  # block 0 stays free: the padding rows read it
    for length in lengths:
        blocks = -(-(length + 1) // runner.block_size)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    prefill = AttentionMetadata.build(lengths, lengths, tables,
                                      [t[p // 4] * 4 + p % 4 for t, n in zip(tables, lengths) for p in range(n)])
    ids = torch.randint(0, 96, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    runner.forward(ids, positions, prefill, runner.kv_caches)
    slots = [t[n // 4] * 4 + n % 4 for t, n in zip(tables, lengths)]
    meta = AttentionMetadata.build([1] * len(lengths), [n + 1 for n in lengths], tables, slots)
    return torch.randint(0, 96, (len(lengths),), generator=g), torch.tensor(lengths), meta


@pytest.mark.parametrize("lengths", [[5], [3, 9, 17], [7] * 5, [2, 30, 11, 4, 4, 9, 1, 13, 6]])
def test_padded_buffers_give_the_unpadded_step(lengths):
    runner = _runner()
    ids, positions, meta = _decode_step(runner, lengths)
    snapshot = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    expected = runner.forward(ids, positions, meta, runner.kv_caches)
    after_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):  # the step again, from the same cache
        k.copy_(k0)
        v.copy_(v0)
    graphs = DecodeGraphs(runner.forward, runner.kv_caches, max_num_seqs=16, max_model_len=64,
                          block_size=runner.block_size, device="cpu", capture=False)
    assert graphs.fits(meta)
    got = graphs(ids, positions, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The padding rows wrote nothing: the caches are what the unpadded step left.
    for (k, v), (k1, v1) in zip(runner.kv_caches, after_eager):
        assert torch.equal(k, k1) and torch.equal(v, v1)


def test_steps_that_do_not_fit_are_refused():
    runner = _runner()
    graphs = DecodeGraphs(runner.forward, runner.kv_caches, max_num_seqs=4, max_model_len=32,
                          block_size=runner.block_size, device="cpu", capture=False)
    prefill = AttentionMetadata.build([3], [3], [[1]], [4, 5, 6])
    assert not graphs.fits(prefill)
    too_many = AttentionMetadata.build([1] * 5, [2] * 5, [[1]] * 5, [5] * 5)
    assert not graphs.fits(too_many)
    too_long = AttentionMetadata.build([1], [40], [list(range(1, 11))], [39])
    assert not graphs.fits(too_long)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (bench/gpu_check.sh)")
def test_graph_replay_gives_the_eager_step():
    runner = _runner("cuda")
    ids, positions, meta = _decode_step(runner, [3, 9, 17])
    ids, positions = ids.cuda(), positions.cuda()
    meta = AttentionMetadata.build([1] * 3, meta.seq_lens.tolist(), meta.block_tables.tolist(),
                                   meta.slot_mapping.tolist(), "cuda")
    expected = runner.forward(ids, positions, meta, runner.kv_caches)
    graphs = DecodeGraphs(runner.forward, runner.kv_caches, max_num_seqs=8, max_model_len=64,
                          block_size=runner.block_size, device="cuda")
    torch.testing.assert_close(graphs(ids, positions, meta), expected, rtol=0, atol=0)


def test_enforce_eager_is_checked_and_the_cpu_runs_eagerly():
    import kvpage

    from kvpage.model.cuda_graphs import CudaGraphConfig

    runner = _runner()
    asked = ModelRunner(runner.model, num_kv_blocks=8, block_size=4, cuda_graphs=CudaGraphConfig(8, 64))
    assert asked.graphs is None  # asked for, but a CPU has none: every step runs eagerly
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        kvpage.LLM(model=runner.model, enforce_eager="yes")


class _CountingGraphs(DecodeGraphs):
    calls = 0

    def __call__(self, input_ids, positions, meta):
        self.calls += 1
        return super().__call__(input_ids, positions, meta)


def test_the_engine_through_the_padded_buffers_gives_the_eager_engines_tokens():
    """ModelRunner.execute's graph branch end to end on a CPU: every decode step that fits goes through
    DecodeGraphs' padded buffers (run eagerly here), filled from the step payload, while prefills run
    the forward directly; greedy tokens must equal those of the engine that never uses the buffers."""
    import kvpage

    torch.manual_seed(0)
    # Weights 10x HF's default scale: attention then moves the logits enough that a wrong position,
    # slot or table row in the buffers changes the tokens.
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    prompts = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate([5, 11, 3, 17, 8])]
    params = kvpage.SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    eager = kvpage.LLM(model=model, num_kv_blocks=64, block_size=4)
    padded = kvpage.LLM(model=model, num_kv_blocks=64, block_size=4)
    runner = padded.runner
    runner.graphs = _CountingGraphs(runner.forward, runner.kv_caches, max_num_seqs=8, max_model_len=64,
                                    block_size=runner.block_size, device="cpu", capture=False)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert runner.graphs.calls >= params.max_tokens - 1  # 5 sequences in the bucket of 8: 3 padding rows
