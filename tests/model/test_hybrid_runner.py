"""The runner's side of a hybrid KV cache (kvpage.core.kv_cache_groups): group_size cache pairs shared by the
groups, every group's block tables and slot mappings through the step payload and the TP broadcast, and each
layer reading its own group's (AttentionMetadata.for_layer)."""
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

from kvpage.core.kv_cache_groups import NULL_BLOCK, KVCacheGroup, KVCacheLayout, kv_cache_layout
from kvpage.distributed import protocol
from kvpage.model import ModelInput, ModelRunner, SequenceInput
from kvpage.model.runner import kv_cache_bytes_per_block, model_kv_cache_layout, num_blocks_for_memory
from kvpage.model.step_inputs import pack_payload, unpack_payload
from tiny_models import random_prompts, tiny_model

BLOCK = 8
CPU = torch.device("cpu")


def slots_of(table: list[int], start: int, n: int) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]


def grouped(seq: SequenceInput, tables: list[list[int]]) -> SequenceInput:
    """seq with one block table per group (group 0's is its own block_table)."""
    n = len(seq.token_ids)
    return SequenceInput(seq.token_ids, seq.start, tables[0], slots_of(tables[0], seq.start, n), seq.do_sample,
                         block_tables=tables, slot_mappings=[slots_of(t, seq.start, n) for t in tables])


def two_group_step() -> ModelInput:
    seqs = [grouped(SequenceInput([5, 6, 7], 0, [], []), [[4], [9]]),
            grouped(SequenceInput([9], 9, [], []), [[1, 2, 7], [3, 0, 8]])]
    return ModelInput(seqs, blocks_to_copy=[(2, 5)])


def test_payload_round_trip_carries_every_group():
    batch = two_group_step()
    sizes, payload = pack_payload(batch, BLOCK)
    assert sizes.num_groups == 2 and sizes.width == 3
    meta = unpack_payload(sizes, payload, CPU).metadata
    assert meta.num_groups == 2
    assert meta.group_block_tables.tolist() == [[[4, 0, 0], [1, 2, 7]], [[9, 0, 0], [3, 0, 8]]]
    assert meta.group_slot_mappings.tolist() == [[32, 33, 34, 17], [72, 73, 74, 1]]
    assert meta.group_block_tables.dtype == torch.int32 and meta.group_slot_mappings.dtype == torch.int64
    # Group 0's are the one-group fields; each group's view shares the step's lengths.
    assert torch.equal(meta.block_tables, meta.group_block_tables[0])
    assert torch.equal(meta.slot_mapping, meta.group_slot_mappings[0])
    meta.layer_groups = (0, 1, 1, 0)
    for layer, g in enumerate(meta.layer_groups):
        view = meta.for_layer(layer)
        assert torch.equal(view.block_tables, meta.group_block_tables[g]) and view.seq_lens is meta.seq_lens
        assert torch.equal(view.slot_mapping, meta.group_slot_mappings[g]) and view.num_groups == 1
    assert meta.for_group(1) is meta.for_layer(1)  # built once per step


def test_one_group_payload_is_todays():
    """A step whose sequences carry one group's fields packs exactly as one without them."""
    plain = ModelInput([SequenceInput([5, 6, 7], 0, [4], [32, 33, 34])])
    one = ModelInput([grouped(SequenceInput([5, 6, 7], 0, [], []), [[4]])])
    (sizes, payload), (sizes1, payload1) = pack_payload(plain, BLOCK), pack_payload(one, BLOCK)
    assert sizes == sizes1 and sizes.num_groups == 1 and torch.equal(payload, payload1)
    meta = unpack_payload(sizes, payload, CPU).metadata
    assert meta.group_block_tables is None and meta.for_layer(5) is meta


def test_payload_refuses_malformed_groups():
    seq = grouped(SequenceInput([5, 6], 0, [], []), [[4], [9]])
    with pytest.raises(ValueError, match="same number of KV-cache groups"):
        pack_payload(ModelInput([seq, SequenceInput([1], 0, [3], [24])]), BLOCK)
    seq.block_tables = [[4], []]
    with pytest.raises(ValueError, match="cannot hold"):
        pack_payload(ModelInput([seq]), BLOCK)
    seq.block_tables, seq.slot_mappings = [[4], [9]], [[32, 33]]
    with pytest.raises(ValueError, match="one per KV-cache group"):
        pack_payload(ModelInput([seq]), BLOCK)


def test_tensor_parallel_broadcast_carries_every_group():
    """The TP header carries num_groups, so every rank unpacks the same per-group tables."""
    batch = two_group_step()
    h, payload = protocol.pack_step(batch, message=3, block_size=BLOCK)
    assert int(h[protocol.NUM_GROUPS]) == 2
    sent = unpack_payload(*pack_payload(batch, BLOCK), CPU)
    got = protocol.unpack_step(h, payload, CPU)
    for name in ("group_block_tables", "group_slot_mappings", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(got.metadata, name), getattr(sent.metadata, name)), name
    assert got.blocks.blocks_to_copy == [[2, 5]]


def two_full_groups(num_layers: int) -> KVCacheLayout:
    """Layers split alternately into two full-attention groups: per-group tables with no window kernel."""
    return KVCacheLayout((KVCacheGroup(None, tuple(range(0, num_layers, 2))),
                          KVCacheGroup(None, tuple(range(1, num_layers, 2)))), num_layers // 2)


def test_layout_allocates_group_size_pairs_shared_by_the_groups():
    model = tiny_model("llama", num_hidden_layers=4)
    layout = two_full_groups(4)
    runner = ModelRunner(model, num_kv_blocks=6, block_size=BLOCK, num_host_blocks=2, kv_cache_layout=layout)
    assert len(runner.kv_cache_pairs) == 2 and len(runner.host_kv_caches) == 2
    for layer in range(4):
        assert runner.kv_caches[layer] is runner.kv_cache_pairs[layout.layer_slot(layer)[1]]
    full = kv_cache_bytes_per_block(model.config, BLOCK, torch.float32)
    assert runner.kv_cache_bytes_per_block() == full // 2
    assert runner.num_blocks_for_memory(1.0) == num_blocks_for_memory(model.config, 1.0, BLOCK, torch.float32) * 2
    # Block moves go over the pairs once each, not once per layer.
    runner.kv_cache_pairs[1][1][2] = 2.5
    runner.execute(ModelInput(blocks_to_copy=[(2, 5)], blocks_to_swap_out=[(2, 1)]))  # out, then copy
    assert bool((runner.kv_caches[3][1][5] == 2.5).all()) and bool((runner.host_kv_caches[1][1][1] == 2.5).all())


def test_layouts_the_runner_refuses():
    model = tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="kv_cache_layout must place each of the model's 4 layers"):
        ModelRunner(model, num_kv_blocks=4, block_size=BLOCK, kv_cache_layout=kv_cache_layout([None, 8]))
    runner = ModelRunner(model, num_kv_blocks=8, block_size=BLOCK, kv_cache_layout=two_full_groups(4))
    with pytest.raises(ValueError, match="1 KV-cache group.*kv_cache_layout has 2"):
        runner.execute(ModelInput([SequenceInput([1, 2], 0, [0], [0, 1])]))
    one = ModelRunner(tiny_model("llama", num_hidden_layers=4), num_kv_blocks=8, block_size=BLOCK)
    with pytest.raises(ValueError, match="2 KV-cache group.*kv_cache_layout has 1"):
        one.execute(two_group_step())


def run_steps(runner: ModelRunner, prompts: list[list[int]], tables, decode_tokens: int) -> list[torch.Tensor]:
    """Prefill every prompt, then decode_tokens greedy steps; each sequence's block table per group is
    tables(i, g). Returns each step's logits."""
    num_groups = runner.layout.num_groups
    seqs = [grouped(SequenceInput(p, 0, [], []), [tables(i, g) for g in range(num_groups)])
            for i, p in enumerate(prompts)]
    out = [runner.execute(ModelInput(seqs))]
    starts = [len(p) for p in prompts]
    for _ in range(decode_tokens):
        nxt = out[-1].argmax(-1).tolist()
        seqs = [grouped(SequenceInput([t], s, [], []), [tables(i, g) for g in range(num_groups)])
                for i, (t, s) in enumerate(zip(nxt, starts))]
        out.append(runner.execute(ModelInput(seqs)))
        starts = [s + 1 for s in starts]
    return out


@pytest.mark.parametrize("generic", [False, True])  # kvpage's own forward, or HF's modules
def test_per_group_tables_give_one_tables_logits(generic, monkeypatch):
    """Two groups, each sequence in other blocks per group (one pool, shared pairs), compute what one group
    of all layers computes: each layer writes and reads its own group's blocks only."""
    if generic:
        monkeypatch.setattr("kvpage.model.runner.llama_family_mismatch", lambda config: "the generic path")
    model = tiny_model("llama", num_hidden_layers=4)
    prompts = random_prompts([13, 6, 20])
    one = ModelRunner(model, num_kv_blocks=12, block_size=BLOCK)
    want = run_steps(one, prompts, lambda i, g: [4 * i + k for k in range(4)], decode_tokens=5)
    hybrid = ModelRunner(tiny_model("llama", num_hidden_layers=4), num_kv_blocks=24, block_size=BLOCK,
                         kv_cache_layout=two_full_groups(4))
    # Group 1 takes the blocks group 0 does not, in reverse: no block id means the same in both groups.
    got = run_steps(hybrid, prompts, lambda i, g: [4 * i + k if g == 0 else 23 - 4 * i - k for k in range(4)], 5)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def window_model(family: str, seed: int = 0):
    """A tiny random model with window and full layers: Gemma 3's pattern (HF's modules run it) or Qwen2 with
    use_sliding_window (kvpage's own forward). Large weights: a token outside the window changes the logits."""
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.3,
                  tie_word_embeddings=False)
    if family == "gemma3":
        config = Gemma3TextConfig(**common, sliding_window=12, query_pre_attn_scalar=32,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        return Gemma3ForCausalLM(config).eval()
    config = Qwen2Config(**common, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    return Qwen2ForCausalLM(config).eval()


def run_chunked(runner: ModelRunner, prompts: list[list[int]], decode_tokens: int, chunk: int = 10,
                drop_outside_windows: bool = True) -> list[torch.Tensor]:
    """Prefill in chunks of `chunk` tokens, then greedy decode steps, each sequence in blocks of its own per
    group. With drop_outside_windows, before every step a window group's table entries of blocks no query
    of the step can see become NULL_BLOCK and those blocks are filled with NaN: a read of one shows."""
    layout, bs, n = runner.layout, runner.block_size, len(prompts)
    width = -(-(max(map(len, prompts)) + decode_tokens) // bs)
    tables = [[[(g * n + i) * width + k for k in range(width)] for g in range(layout.num_groups)] for i in range(n)]
    tokens, done, out = [list(p) for p in prompts], [0] * n, []
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < decode_tokens:
        seqs, which = [], [i for i in range(n) if done[i] < len(tokens[i])]
        for i in which:
            if drop_outside_windows:
                _drop_outside_windows(runner, tables[i], done[i])
            todo = tokens[i][done[i]:done[i] + chunk]
            seqs.append(grouped(SequenceInput(todo, done[i], [], [], do_sample=done[i] + len(todo) == len(tokens[i])),
                                tables[i]))
            done[i] += len(todo)
        out.append(runner.execute(ModelInput(seqs)))
        sampled = [i for i, s in zip(which, seqs) if s.do_sample]
        for i, row in zip(sampled, out[-1]):
            tokens[i].append(int(row.argmax()))
    return out


def _drop_outside_windows(runner: ModelRunner, tables: list[list[int]], start: int) -> None:
    """A window group keeps positions from max(0, start - W + 1) on (the contract's rule)."""
    for g, group in enumerate(runner.layout.groups):
        if group.sliding_window is None:
            continue
        for k in range(max(0, start - group.sliding_window + 1) // runner.block_size):
            if tables[g][k] != NULL_BLOCK:
                for key, value in runner.kv_cache_pairs:
                    key[tables[g][k]], value[tables[g][k]] = float("nan"), float("nan")
                tables[g][k] = NULL_BLOCK


@pytest.mark.parametrize("family", ["gemma3", "qwen2_sliding"])  # HF's modules; kvpage's own forward
def test_window_groups_free_blocks_yet_give_full_tables_logits(family):
    """The model's own layout (full + window groups, the window groups' blocks before the window dropped and
    poisoned) gives the logits of one group of full tables (the window applied by the kernels alone), through
    chunked prefill and decode several windows long."""
    reference, model = window_model(family), window_model(family)
    layout = model_kv_cache_layout(model.config)
    assert layout.num_groups > 1 and layout.is_hybrid
    prompts = random_prompts([45, 23, 31])
    full = ModelRunner(reference, num_kv_blocks=3 * layout.num_groups * 10, block_size=BLOCK)
    want = run_chunked(full, prompts, decode_tokens=24, drop_outside_windows=False)
    hybrid = ModelRunner(model, num_kv_blocks=3 * layout.num_groups * 10, block_size=BLOCK, kv_cache_layout=layout)
    got = run_chunked(hybrid, prompts, decode_tokens=24)
    assert len(got) == len(want) > 24
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_several_groups_run_eagerly_where_one_would_replay_graphs(monkeypatch):
    """CUDA graphs' buffers hold one group's tables: a runner of several groups runs every step eagerly
    (enforce_eager's meaning is unchanged: it turns graphs off for every model)."""
    from kvpage.model.cuda_graphs import CudaGraphConfig

    monkeypatch.setattr("kvpage.model.runner.DecodeGraphs", lambda *args: "graphs")
    for layout, want in ((None, "graphs"), (two_full_groups(4), None)):
        runner = ModelRunner(tiny_model("llama", num_hidden_layers=4), num_kv_blocks=8, block_size=BLOCK,
                             kv_cache_layout=layout)
        runner.device = torch.device("cuda")  # as on a GPU: the graphs' other conditions hold
        assert runner._decode_graphs(CudaGraphConfig(max_num_seqs=4, max_model_len=64)) == want
