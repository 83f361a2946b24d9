"""KV memory arithmetic against values worked by hand (the seed: 8k context, 16-token blocks ->
512 blocks, a table of about 2 KiB)."""
import json

import pytest

from kvpage.costmodel import (block_table_bytes, blocks_per_sequence, capacity, from_hf_config, get_device,
                              get_model, kv_budget_bytes, kv_bytes_per_block, kv_bytes_per_token, paged_slots,
                              reserved_slots)

LLAMA = get_model("llama-3-8b")
SMOL = get_model("smollm2-135m")


def test_kv_bytes_per_token_is_k_and_v_over_layers_heads_and_dims():
    assert kv_bytes_per_token(LLAMA, 2) == 32 * 8 * 128 * 2 * 2 == 131072  # 128 KiB
    assert kv_bytes_per_token(SMOL, 4) == 30 * 3 * 64 * 2 * 4 == 46080  # the engine's fp32 default
    assert kv_bytes_per_block(LLAMA, 16, 2) == 2 * 2**20  # 2 MiB a block


def test_an_8k_sequence_needs_512_blocks_and_a_2_kib_table():
    assert blocks_per_sequence(8192, 16) == 512
    assert block_table_bytes(8192, 16) == 512 * 4 == 2048
    # A new block only once the previous one is full: the 17th token takes the second.
    assert [blocks_per_sequence(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="block_size"):
        blocks_per_sequence(10, 0)


def test_parameter_counts_worked_by_hand():
    # Llama-3-8B: embeddings 128256 x 4096, untied head; a layer: q 4096^2, k and v 4096 x 1024,
    # o 4096^2, MLP 3 x 4096 x 14336, two norms of 4096.
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    assert LLAMA.layer_params == layer == 218_112_000
    assert LLAMA.num_params == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    # SmolLM2-135M: tied embeddings 49152 x 576, 9 heads / 3 KV heads of 64, MLP 1536.
    assert SMOL.num_params == 49152 * 576 + 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576) + 576
    assert SMOL.num_params == 134_515_008
    assert LLAMA.flops_per_token == 2 * 32 * layer


def test_attention_flops_count_causal_pairs():
    # 4 new tokens over 10 cached: 4 * 10 + (1 + 2 + 3 + 4) = 50 pairs, 4 * q_dim FLOPs each per layer.
    assert SMOL.attention_flops(4, 10) == 4 * 30 * 576 * 50


def test_paging_vs_reservation_capacity_on_an_h100():
    h100 = get_device("h100")
    budget = 0.9 * 80 * 2**30 - 8_030_261_248 * 2
    assert kv_budget_bytes(LLAMA, h100, 2, 0.9) == pytest.approx(budget)
    cap = capacity(LLAMA, h100, context_len=8192, mean_len=500, block_size=16, dtype_bytes=2)
    blocks = int(budget // (2 * 2**20))
    assert cap.budget_blocks == blocks == 29205
    assert cap.seqs_reserved == blocks * 16 // 8192 == 57
    assert cap.seqs_paged == int(blocks * 16 // (500 + 7.5)) == 920  # half a block of waste each
    assert cap.reserved_waste == pytest.approx(1 - 500 / 8192)
    assert cap.paged_waste == pytest.approx(7.5 / 507.5)


def test_weights_that_do_not_fit_are_an_error():
    with pytest.raises(ValueError, match="do not fit"):
        kv_budget_bytes(LLAMA, get_device("h100"), dtype_bytes=2, memory_utilization=0.1)


def test_slots_paged_and_reserved():
    assert paged_slots([1, 16, 17], 16) == (1 + 1 + 2) * 16
    assert reserved_slots([1, 16, 17], 2048) == 3 * 2048


def test_shape_from_a_hf_config_json(tmp_path):
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
              "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = get_model(tmp_path)
    assert (shape.head_dim, shape.num_params) == (64, SMOL.num_params)  # head_dim = hidden / heads
    assert from_hf_config({**config, "head_dim": 32}).head_dim == 32


def test_bad_model_names_and_configs_raise():
    with pytest.raises(ValueError, match="model must be one of"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        from_hf_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        from_hf_config({"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                        "num_key_value_heads": 3, "intermediate_size": 8, "vocab_size": 8})
