"""The sharding plan and the step protocol, in one process (no workers)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvpage
from kvpage.distributed import protocol
from kvpage.model import ModelInput, SequenceInput
from kvpage.model.tensor_parallel import ShardPlan

from tp_helpers import random_prompts, tiny_llama


def config(heads, kv_heads, intermediate=1536, vocab=49152, head_dim=64):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                           vocab_size=vocab, head_dim=head_dim, hidden_size=heads * head_dim)


def test_smollm2_splits_by_whole_kv_groups():
    """9 query heads in 3 groups of 3 over 2 ranks: whole groups, unevenly; MLP and vocab evenly."""
    plan = ShardPlan.build(config(9, 3), 2)
    r0, r1 = plan.ranks
    assert (r0.q_heads, r0.kv_heads) == (range(0, 3), range(0, 1))
    assert (r1.q_heads, r1.kv_heads) == (range(3, 9), range(1, 3))
    assert (r0.intermediate, r1.intermediate) == (range(0, 768), range(768, 1536))
    assert (r0.vocab, r1.vocab) == (range(0, 24576), range(24576, 49152))
    assert [plan.kv_cache_fraction(r) for r in (0, 1)] == [1 / 3, 2 / 3]


def test_fewer_kv_heads_than_ranks_replicates_them():
    plan = ShardPlan.build(config(4, 1), 2)  # MQA: the one KV head on both ranks
    assert [(s.q_heads, s.kv_heads) for s in plan.ranks] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    plan = ShardPlan.build(config(6, 2), 4)  # 2 groups of 3 over 4 ranks: each group's heads split 1 / 2
    assert [(s.q_heads, s.kv_heads) for s in plan.ranks] == [
        (range(0, 1), range(0, 1)), (range(1, 3), range(0, 1)), (range(3, 4), range(1, 2)), (range(4, 6), range(1, 2))]


@pytest.mark.parametrize("heads,kv_heads", [(h, k) for h in range(1, 13) for k in range(1, h + 1) if h % k == 0])
def test_every_split_keeps_each_ranks_gqa_uniform(heads, kv_heads):
    """For every world size up to the head count: each query head on exactly one rank, each rank's local
    group mapping the global one (ShardPlan._check), and no rank holding more KV heads than it must."""
    for n in range(1, heads + 1):
        plan = ShardPlan.build(config(heads, kv_heads, intermediate=64, vocab=100), n)
        assert sorted(h for s in plan.ranks for h in s.q_heads) == list(range(heads))
        most = max(s.num_kv_heads for s in plan.ranks)
        assert most == (-(-kv_heads // n) if kv_heads >= n else 1)
        assert max(len(s.intermediate) for s in plan.ranks) - min(len(s.intermediate) for s in plan.ranks) <= 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_tensor_parallel_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ShardPlan.build(config(9, 3), bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        kvpage.LLM(model=tiny_llama(), tensor_parallel_size=bad)


def test_more_ranks_than_heads_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size=10 exceeds .* 9 attention heads"):
        ShardPlan.build(config(9, 3), 10)
    model = tiny_llama(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        kvpage.LLM(model=model, tensor_parallel_size=3, num_kv_blocks=8)


def test_models_it_cannot_shard_are_refused_before_any_process_starts(monkeypatch):
    """GPT-2 (fused c_attn, no Llama-style layers) and OLMo 2 (q_norm over all heads) run at TP=1 but cannot
    be split: a ValueError up front, not an AttributeError or a worker crashing at the first step."""
    from transformers import GPT2Config, GPT2LMHeadModel, Olmo2Config, Olmo2ForCausalLM
    from kvpage.distributed import executor

    monkeypatch.setattr(executor, "WorkerProcesses", lambda specs: pytest.fail("a worker was started"))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 supports HF Llama-family models.*GPT2LMHeadModel"):
        kvpage.LLM(model=gpt2, tensor_parallel_size=2, num_kv_blocks=8)
    olmo2 = Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="cannot split Olmo2ForCausalLM: its attention's q_norm"):
        kvpage.LLM(model=olmo2, tensor_parallel_size=2, num_kv_blocks=8)


def test_unpacked_step_is_the_flat_batch():
    """What every rank runs from the broadcast: the sequences' tokens back to back, with their positions,
    slots, padded block tables and the rows whose logits come back, in the dtypes the kernels take."""
    prompts = random_prompts([7, 20, 3])
    slots = [[4 * 16 + i for i in range(7)], [16 + 2, 16 + 3], [9 * 16 + i for i in range(3)]]
    seqs = [SequenceInput(prompts[0], 0, [4, 5], slots[0]),
            SequenceInput(prompts[1][-2:], 18, [0, 1], slots[1], do_sample=False),
            SequenceInput(prompts[2], 0, [9], slots[2])]
    batch = ModelInput(seqs, blocks_to_swap_out=[(2, 0)], blocks_to_swap_in=[(1, 3)], blocks_to_copy=[(5, 6), (7, 8)])
    h, payload = protocol.pack_step(batch, 7, block_size=16)
    step = protocol.unpack_step(h, payload, torch.device("cpu"))
    assert int(h[protocol.MESSAGE]) == 7 and payload.dtype == torch.int32
    assert step.input_ids.tolist() == prompts[0] + prompts[1][-2:] + prompts[2]
    assert step.positions.tolist() == list(range(7)) + [18, 19] + list(range(3))
    meta = step.metadata
    assert meta.slot_mapping.tolist() == slots[0] + slots[1] + slots[2]
    assert meta.block_tables.tolist() == [[4, 5], [0, 1], [9, 0]]
    assert meta.seq_lens.tolist() == [7, 20, 3] and meta.query_start_loc.tolist() == [0, 7, 9, 12]
    assert (meta.max_query_len, meta.max_seq_len) == (7, 20)
    assert step.sample_rows.tolist() == [6, 11]  # the last tokens of the sequences that sample
    assert [t.dtype for t in (step.input_ids, step.positions, meta.slot_mapping, step.sample_rows)] == [torch.int64] * 4
    assert [t.dtype for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)] == [torch.int32] * 3
    assert step.blocks.blocks_to_swap_out == [[2, 0]] and step.blocks.blocks_to_swap_in == [[1, 3]]
    assert step.blocks.blocks_to_copy == [[5, 6], [7, 8]]
    assert protocol.message_bytes(h, payload) == 8 * protocol.HEADER_LEN + 4 * payload.numel()


def test_a_step_that_only_moves_blocks_has_no_forward_pass():
    h, payload = protocol.pack_step(ModelInput(blocks_to_copy=[(1, 2)]), 0, block_size=16)
    step = protocol.unpack_step(h, payload, torch.device("cpu"))
    assert step.metadata is None and step.blocks.blocks_to_copy == [[1, 2]] and step.input_ids.numel() == 0


@pytest.mark.parametrize("seq,match", [
    (SequenceInput([], 0, [0], []), "needs >= 1 token"),
    (SequenceInput([1, 2], 0, [0], [0]), "one slot per token"),
    (SequenceInput([1] * 20, 0, [0], list(range(20))), "cannot hold 20 tokens"),
    (SequenceInput([2**31], 0, [0], [0]), "fit in int32"),
])
def test_malformed_steps_are_refused_before_sending(seq, match):
    with pytest.raises(ValueError, match=match):
        protocol.pack_step(ModelInput([seq]), 0, block_size=16)
