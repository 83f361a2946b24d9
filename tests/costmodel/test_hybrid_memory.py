"""Memory planning for a hybrid KV cache: per-group bytes per block id, blocks per sequence over the groups
(a window group holds only its window's), and `kvpage plan`'s lines for a model with sliding windows."""
import pytest

from kvpage.costmodel import Workload, get_device, get_model, plan_text
from kvpage.costmodel import memory
from kvpage.costmodel.model import from_hf_config

GEMMA3 = get_model("gemma-3-27b")  # 52 window layers of 1,024 and 10 full ones, 16 KV heads x 128


def test_gemma3_groups_and_bytes_per_block_id():
    layout = GEMMA3.kv_cache_layout
    assert layout.group_size == 10 and layout.num_groups == 7  # 1 full group; 52 window layers in 6 groups of 10
    assert layout.sliding_windows == (None,) + (1024,) * 6
    assert memory.kv_bytes_per_block(GEMMA3, 16, 2) == 16 * 2 * 10 * 16 * 128 * 2  # K and V of 10 layers


def test_blocks_per_sequence_count_what_each_group_holds():
    # 16,384 tokens of 16: the full group keeps 1,024 blocks; a decode query's window of 1,024 positions
    # touches at most 65 blocks (64 when aligned, one more when not), in each of the 6 window groups.
    assert memory.seq_blocks(GEMMA3, 16384, 16) == 1024 + 6 * 65
    assert memory.seq_blocks(GEMMA3, 100, 16) == 7 * 7  # shorter than the window: every group holds it all
    # A prefill chunk of 512 tokens holds the window behind its first token plus its own blocks.
    assert memory.seq_blocks(GEMMA3, 16384, 16, max_step_tokens=512) == 1024 + 6 * ((1023 + 512 + 14) // 16 + 1)
    llama = get_model("llama-3-8b")  # no window: one group, today's count
    assert memory.seq_blocks(llama, 16384, 16) == memory.blocks_per_sequence(16384, 16) == 1024


def test_capacity_counts_block_ids_of_one_group():
    h100 = get_device("h100")
    cap = memory.capacity(GEMMA3, h100, context_len=16384, mean_len=16000, block_size=16, dtype_bytes=2)
    assert cap.budget_blocks == int(cap.kv_budget_bytes // memory.kv_bytes_per_block(GEMMA3, 16, 2))
    per_seq = (16000 + 7.5) / 16 + 6 * 65  # the full group's expected blocks, the window groups' 65 each
    assert cap.seqs_paged == int(cap.budget_blocks // per_seq)
    # Without windows the same model (every layer full) fits about a fifth as many.
    full = memory.capacity(get_model_without_windows(), h100, 16384, 16000, 16, 2)
    assert full.seqs_paged == int(full.budget_tokens // (16000 + 7.5))
    assert cap.seqs_paged >= 4 * full.seqs_paged


def get_model_without_windows():
    from dataclasses import replace

    return replace(GEMMA3, name="gemma-3-27b-all-full", layer_windows=())


def test_windows_from_a_hf_config():
    gemma3_text = dict(model_type="gemma3_text", num_hidden_layers=12, hidden_size=256, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=64, intermediate_size=512, vocab_size=1000,
                       sliding_window=512, layer_types=["full_attention" if (l + 1) % 6 == 0 else "sliding_attention"
                                                        for l in range(12)])
    shape = from_hf_config(gemma3_text)
    assert shape.layer_windows == tuple(None if (l + 1) % 6 == 0 else 512 for l in range(12))
    assert shape.kv_cache_layout.group_size == 2 and shape.kv_cache_layout.num_groups == 6
    mistral = dict(model_type="mistral", num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                   num_key_value_heads=1, intermediate_size=512, vocab_size=1000, sliding_window=4096)
    assert from_hf_config(mistral).layer_windows == (4096,) * 4  # one window group of every layer
    del mistral["sliding_window"]
    assert from_hf_config(mistral).layer_windows == ()


def test_plan_prints_the_groups_only_for_a_hybrid_model():
    text = plan_text(GEMMA3, get_device("h100"), Workload(context_len=16384))
    assert "KV-cache groups (hybrid)                   1 full + 6 window (1024) of 10 layers" in text
    assert "blocks per sequence at 16384 tokens            1414" in text
    # Every layer full: 1,024 blocks of 62 layers = 6,349 of this pool's 10-layer block ids.
    assert "blocks per sequence at 16384, every layer full 6349  (hybrid: 1414, 22.3%)" in text
    assert "KV-cache groups" not in plan_text(get_model("llama-3-8b"), get_device("h100"))


@pytest.mark.parametrize("bad", [(None,), (1024,) * 61])
def test_layer_windows_must_name_every_layer(bad):
    from dataclasses import replace

    with pytest.raises(ValueError, match="layer_windows must name each of the 62 layers"):
        replace(GEMMA3, layer_windows=bad)


def test_rank_capacity_agrees_with_the_memory_section():
    from kvpage.costmodel import ParallelConfig, rank_capacity

    h100 = get_device("h100")
    rank = rank_capacity(ParallelConfig(GEMMA3, 1, 1), h100, 2, mean_len=16000)
    cap = memory.capacity(GEMMA3, h100, 16384, 16000, 16, 2)
    assert (rank.blocks_per_rank, rank.seqs_paged) == (cap.budget_blocks, cap.seqs_paged)
    # One sequence: the full group fills what the six window groups' 65 blocks each leave.
    assert rank.max_context_tokens == (rank.blocks_per_rank - 6 * 65) * 16
    two = ParallelConfig(GEMMA3, 2, 1)
    assert two.rank_block_bytes(2) == 16 * 2 * 10 * 8 * 128 * 2  # 8 of 16 KV heads, 10 layers per block id
    assert two.kv_bytes_per_token_per_rank(2) == 2 * 62 * 8 * 128 * 2  # every layer, per token


def test_plan_splits_window_groups_over_decode_context_parallel_ranks():
    """DCP with window layers, as LLM runs it: block ids are virtual blocks (block_size on each rank), so the
    window groups' blocks per sequence and the longest context are counted in them; a window that D * I does
    not divide is refused by name."""
    from dataclasses import replace

    from kvpage.costmodel import ParallelConfig, rank_capacity

    h100 = get_device("h100")
    tp, dcp = ParallelConfig(GEMMA3, 16, 1), ParallelConfig(GEMMA3, 32, 2)  # one KV head per rank both
    one, two = (rank_capacity(pc, h100, 2, mean_len=16000) for pc in (tp, dcp))
    # A block id is 32 positions at D=2: the window groups hold ceil(1024 / 32) + 1 = 33 each.
    assert two.max_context_tokens == (two.blocks_per_rank - 6 * 33) * 32
    assert two.max_context_tokens > one.max_context_tokens
    odd = replace(GEMMA3, layer_windows=tuple(w and 1000 for w in GEMMA3.layer_windows))
    with pytest.raises(ValueError, match="sliding_window=1000 must be a multiple"):
        ParallelConfig(odd, 32, 2, dcp_kv_cache_interleave_size=16)  # 1000 % (16 * 2) == 8
