"""Tensor x decode context parallelism in the cost model, against independent computation: hand-worked
byte counts, enumeration of positions, tensor shapes of the collectives, and today's single-GPU numbers."""
import math
import re

import pytest

from kvpage import cli
from kvpage.costmodel import (ParallelConfig, capacity, dcp_traffic, from_hf_config, get_device, get_model,
                              kv_bytes_per_token, rank_capacity, tp_all_reduce_bytes)

LLAMA = get_model("llama-3-8b")  # 32 layers, 32 query heads, 8 KV heads of 128
GEMMA = get_model("gemma-2b")  # 18 layers, 8 query heads, 1 KV head of 256 (MQA)
H100 = get_device("h100")
# The engine bench's model: a random Llama with one KV head (hidden 64, 4 heads of 16, 2 layers).
TINY_MQA = from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                           "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 256}, name="tiny-mqa")


def test_at_one_rank_every_number_is_todays_single_gpu_one():
    pc = ParallelConfig(LLAMA)
    assert pc.kv_bytes_per_token_per_rank(2) == kv_bytes_per_token(LLAMA, 2)
    assert pc.weight_bytes_per_rank(2) == LLAMA.weight_bytes(2)
    cap, today = rank_capacity(pc, H100, 2, mean_len=500), capacity(LLAMA, H100, 8192, 500, 16, 2)
    assert (cap.blocks_per_rank, cap.seqs_paged) == (today.budget_blocks, today.seqs_paged)
    assert cap.max_context_tokens == today.budget_tokens


def test_per_rank_kv_bytes_worked_by_hand_for_llama_3_8b():
    per_head = 2 * 32 * 128 * 2  # K and V, 32 layers, head_dim 128, bf16: 16 KiB per head per token
    assert ParallelConfig(LLAMA, 2).kv_bytes_per_token_per_rank(2) == 4 * per_head
    assert ParallelConfig(LLAMA, 8).kv_bytes_per_token_per_rank(2) == per_head
    # The ceiling: past 8 ranks each still holds a whole head, so TP=16 stores as much per rank as TP=8 ...
    tp16 = ParallelConfig(LLAMA, 16)
    assert (tp16.kv_head_replication, tp16.kv_bytes_per_token_per_rank(2)) == (2, per_head)
    # ... until DCP splits the positions of the replicated head between the two ranks that hold it.
    assert ParallelConfig(LLAMA, 16, 2).kv_bytes_per_token_per_rank(2) == per_head / 2 == 8192


def test_dcp_multiplies_the_max_context_by_d_when_heads_are_replicated():
    one = rank_capacity(ParallelConfig(LLAMA, 16, 1), H100, 2, mean_len=500)
    two = rank_capacity(ParallelConfig(LLAMA, 16, 2), H100, 2, mean_len=500)
    assert two.blocks_per_rank == one.blocks_per_rank  # DCP changes what a block id covers, not the blocks
    assert two.max_context_tokens == 2 * one.max_context_tokens
    for d in (1, 2, 4, 8):  # MQA at TP=8: every rank holds the one head, so up to 8x
        cap = rank_capacity(ParallelConfig(GEMMA, 8, d), H100, 2, mean_len=500)
        budget = 0.9 * 80 * 2**30 - ParallelConfig(GEMMA, 8).weight_bytes_per_rank(2)
        blocks = int(budget // (16 * 2 * 18 * 256 * 2))
        assert (cap.blocks_per_rank, cap.max_context_tokens) == (blocks, blocks * 16 * d)
        # Each sequence wastes half a virtual block of 16 * d slots on average.
        assert cap.seqs_paged == int(blocks * 16 * d // (500 + (16 * d - 1) / 2))


def test_the_bench_model_n_blocks_per_rank_hold_n_times_16_times_d_tokens():
    for t, d in ((1, 1), (2, 2), (4, 2), (4, 4)):
        pc = ParallelConfig(TINY_MQA, t, d)
        assert pc.kv_bytes_per_token_per_rank(4) == 2 * 2 * 1 * 16 * 4 / d  # fp32
        assert pc.max_context_tokens(64) == 64 * 16 * d
        assert pc.virtual_block_tokens - 1 == 16 * d - 1  # the most one sequence leaves unfilled


def test_sequences_that_fit_match_allocating_block_ids_one_position_at_a_time():
    for t, d in ((1, 1), (2, 2), (4, 4)):
        pc = ParallelConfig(TINY_MQA, t, d)
        for blocks, seq_len in ((64, 100), (64, 256), (64, 1000), (7, 33)):
            used, fitted = 0, 0
            while True:  # a new block id (one block on each rank) whenever the position starts a virtual block
                need = sum(1 for p in range(seq_len) if p % (16 * d) == 0)
                if used + need > blocks:
                    break
                used, fitted = used + need, fitted + 1
            assert pc.sequences_that_fit(blocks, seq_len) == fitted


def test_weights_per_rank_worked_by_hand_at_tp8():
    h, kv_head, layers = 4096, 128, 32
    layer = (2 * h * h + 3 * h * 14336) / 8 + 2 * h * kv_head + 2 * h  # q, o, MLP split; one KV head; norms
    expected = 2 * 128256 * h / 8 + layers * layer + h
    assert ParallelConfig(LLAMA, 8).weight_bytes_per_rank(2) == pytest.approx(expected * 2)


@pytest.mark.parametrize("d,i", [(1, 1), (2, 1), (2, 16), (4, 4), (4, 8), (8, 2)])
def test_positions_per_rank_match_enumeration(d, i):
    pc = ParallelConfig(GEMMA, 8, d, i)
    for n in (0, 1, 7, 16, 17, 100, 8192, 8195):
        counts = [sum(1 for p in range(n) if (p // i) % d == r) for r in range(d)]
        assert [pc.tokens_on_rank(n, r) for r in range(d)] == counts


def test_dcp_bytes_from_the_collectives_tensor_shapes():
    for model, t, d in ((LLAMA, 16, 2), (GEMMA, 8, 4), (TINY_MQA, 4, 4)):
        pc = ParallelConfig(model, t, d)
        h_local, batch = model.num_heads // t, 5
        query = math.prod((batch, h_local, model.head_dim)) * 2 * (d - 1)  # from each other rank
        outputs = math.prod((batch, d * h_local, model.head_dim)) * 2 * (d - 1) // d
        lses = math.prod((batch, d * h_local)) * 4 * (d - 1) // d
        traffic = dcp_traffic(pc, 2, batch)
        assert (traffic.query_all_gather, traffic.output_all_to_all) == (query, outputs + lses)
        assert traffic.total == query + outputs + lses
    assert dcp_traffic(ParallelConfig(LLAMA, 8), 2, 64).total == 0  # no DCP, nothing moved
    # TP's ring all-reduces for scale: 2 per layer, 2 (T - 1) / T of [tokens, hidden] each.
    assert tp_all_reduce_bytes(ParallelConfig(LLAMA, 8), 2, 1) == 2 * 2 * 7 / 8 * 4096 * 2


def test_the_rules_refuse_by_name():
    with pytest.raises(ValueError, match="decode_context_parallel_size=2 exceeds the KV-head replication"):
        ParallelConfig(LLAMA, 8, 2)  # 8 KV heads over 8 ranks: nothing replicated to split
    with pytest.raises(ValueError, match="decode_context_parallel_size=4 exceeds"):
        ParallelConfig(LLAMA, 16, 4)
    with pytest.raises(ValueError, match="decode_context_parallel_size=3 must divide tensor_parallel_size=8"):
        ParallelConfig(GEMMA, 8, 3)
    with pytest.raises(ValueError, match="dcp_kv_cache_interleave_size=3 must divide block_size=16"):
        ParallelConfig(GEMMA, 8, 2, 3)
    with pytest.raises(ValueError, match="dcp_kv_cache_interleave_size=32 must divide"):
        ParallelConfig(GEMMA, 8, 2, 32)
    with pytest.raises(ValueError, match="tensor_parallel_size=16 must divide the model's 8 attention heads"):
        ParallelConfig(GEMMA, 16)
    three_kv_heads = from_hf_config({"num_hidden_layers": 1, "hidden_size": 96, "num_attention_heads": 12,
                                     "num_key_value_heads": 3, "intermediate_size": 8, "vocab_size": 8})
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the model's 3 KV heads"):
        ParallelConfig(three_kv_heads, 4)
    with pytest.raises(ValueError, match="decode_context_parallel_size must be a positive int"):
        ParallelConfig(LLAMA, 8, 0)


def test_allowed_sizes_are_what_the_rules_accept():
    for model, t in ((LLAMA, 8), (LLAMA, 16), (LLAMA, 32), (GEMMA, 8), (GEMMA, 4)):
        accepted = []
        for d in range(1, t + 1):
            try:
                ParallelConfig(model, t, d)
                accepted.append(d)
            except ValueError:
                pass
        assert ParallelConfig(model, t).allowed_dcp_sizes == accepted
    assert ParallelConfig(LLAMA, 16).allowed_dcp_sizes == [1, 2]
    assert ParallelConfig(GEMMA, 8).allowed_dcp_sizes == [1, 2, 4, 8]


def _plan(capsys, *args) -> str:
    assert cli.main(["plan", "--model", "llama-3-8b", "--device", "h100", *args]) == 0
    return capsys.readouterr().out


def _max_context(out: str) -> int:
    return int(re.search(r"max context the ranks' budget holds\s+(\d+) tokens", out).group(1))


def test_plan_prints_dcp_per_rank_bytes_and_context(capsys):
    one = _plan(capsys, "--tensor-parallel-size", "16")
    two = _plan(capsys, "--tensor-parallel-size", "16", "--decode-context-parallel-size", "2",
                "--decode-batch-size", "4")
    assert "KV bytes per token per rank                16384 B (16 KiB)" in one
    assert "KV bytes per token per rank                8192 B (8 KiB)" in two
    assert "KV-head replication 2" in two and re.search(r"DCP sizes the rules allow at TP=16\s+1, 2\n", two)
    assert _max_context(two) == 2 * _max_context(one)
    traffic = dcp_traffic(ParallelConfig(LLAMA, 16, 2), 2, 4)
    assert f"{traffic.total} B received per rank at 4 decode token(s)" in two
    assert re.search(rf"query all-gather\s+{traffic.query_all_gather} B\n", two)


@pytest.mark.parametrize("args,name", [
    (["--tensor-parallel-size", "8", "--decode-context-parallel-size", "2"], "decode_context_parallel_size=2"),
    (["--tensor-parallel-size", "16", "--decode-context-parallel-size", "3"], "decode_context_parallel_size=3"),
    (["--tensor-parallel-size", "16", "--decode-context-parallel-size", "2", "--dcp-kv-cache-interleave-size",
      "5"], "dcp_kv_cache_interleave_size=5"),
    (["--tensor-parallel-size", "12"], "tensor_parallel_size=12"),
])
def test_plan_refuses_bad_parallel_sizes_by_name(capsys, args, name):
    assert cli.main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert name in captured.err and captured.out == ""
