"""Partial last blocks through the KV offload tier (issue 48; kv_offload.connector's module docstring): a finished
sequence's last, partly filled block is stored in the tier, and a chat's next turn loads those tokens instead of
recomputing them. Multi-turn conversations (each turn's prompt: the last prompt, its answer, new user tokens) on
the tiny random Llama of test_engine_tier.py, block_size 8: greedy, n > 1 and beam tokens equal the tier-off
engine's, with partial hits counted (stats, cached tokens); also under swap and recompute preemption, n-gram
speculative decoding and TP=2. A loaded partial block holds the exact bytes its tokens had; a damaged partial
file is skipped (one warning) and recomputed; a sliding-window layout stores and loads no partials."""
from __future__ import annotations

import copy
import logging
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from integrity_helpers import tiny_llm  # noqa: E402

import kvpage  # noqa: E402
from kvpage import SamplingParams  # noqa: E402
from kvpage.core.block_manager import BlockManager  # noqa: E402
from kvpage.core.hashing import ROOT_HASH, hash_block_tokens, pack_tokens  # noqa: E402
from kvpage.core.kv_cache_groups import kv_cache_layout  # noqa: E402
from kvpage.core.sequence import Sequence  # noqa: E402
from kvpage.kv_offload import HostMemoryTier, OffloadingConnector  # noqa: E402
from kvpage.kv_offload.connector import partial_entries  # noqa: E402

BLOCK = 8
GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 1.0, "seed": 7, "n": 2}
BEAM = {"beam_width": 2}


@pytest.fixture(scope="module")
def base():
    return tiny_llm(num_kv_blocks=48)


def engine(base, **kwargs):
    kwargs.setdefault("num_kv_blocks", 64)
    llm = kvpage.LLM(model=base.model, tokenizer=base.tokenizer, block_size=BLOCK, swap_space_gib=0.001,
                     max_num_batched_tokens=64, **kwargs)
    if llm.llm_engine.kv_connector is not None:
        llm.llm_engine.kv_connector.recompute_seconds = None  # load every hit (no pricing on a loaded machine)
    return llm


def chat(llm, kind: dict, num_conversations: int = 3, turns: int = 4, seed: int = 0, vocab: int = 40000):
    """Conversations of `turns` turns, interleaved: each turn's prompt is the last turn's prompt, its first
    answer and 5-13 new tokens; answers of 3-11 tokens (so they end anywhere in a block). Returns each
    request's (answers' tokens, cached tokens), in order."""
    rng = random.Random(seed)
    history = [[rng.randrange(3, vocab) for _ in range(11 + 3 * c)] for c in range(num_conversations)]
    results = []
    for _ in range(turns):
        params = [SamplingParams(max_tokens=rng.randrange(3, 12), ignore_eos=True, **kind) for _ in history]
        outputs = llm.generate([{"prompt_token_ids": h} for h in history], params, use_tqdm=False)
        for c, out in enumerate(outputs):
            results.append(([list(o.token_ids) for o in out.outputs], out.num_cached_tokens))
            new = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 14))]
            history[c] = history[c] + list(out.outputs[0].token_ids) + new
        if llm.llm_engine.kv_connector is not None:
            llm.llm_engine.runner.flush_tier()
    return results


def answers(results):
    return [tokens for tokens, _ in results]


@pytest.mark.parametrize("where", ["host", "disk"])
@pytest.mark.parametrize("num_kv_blocks", [64, 24])
def test_greedy_same_tokens_with_partial_hits(base, tmp_path, where, num_kv_blocks):
    """64 blocks keep every conversation's full blocks in the pool (only the partials come from the tier); 24
    evict them (full blocks and partials both from the tier)."""
    off = chat(engine(base, num_kv_blocks=num_kv_blocks), GREEDY)
    llm = engine(base, num_kv_blocks=num_kv_blocks, kv_offloading_size=0.05,
                 kv_offloading_dir=str(tmp_path) if where == "disk" else None)
    on = chat(llm, GREEDY)
    assert answers(on) == answers(off)
    stats = llm.stats()
    assert stats["kv_offload_partial_stored_blocks"] > 0
    assert stats["kv_offload_hit_tokens"] >= stats["kv_offload_partial_hit_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] >= stats["kv_offload_hit_tokens"]
    assert sum(c for _, c in on) > sum(c for _, c in off)
    if num_kv_blocks == 64:  # nothing evicted: every tier hit is on top of the same pool hits
        assert sum(c for _, c in on) - sum(c for _, c in off) == stats["kv_offload_hit_tokens"]
        assert stats["kv_offload_hit_tokens"] == stats["kv_offload_partial_hit_tokens"]


@pytest.mark.parametrize("name", ["sampled", "beam"])
def test_n2_and_beam_same_tokens(base, tmp_path, name):
    """n=2 (seeded) and beam search: each finished sequence stores its own partial block; the next turn
    (built on the first answer) loads the matching one."""
    kind = {"sampled": SAMPLED, "beam": BEAM}[name]
    off = chat(engine(base), kind)
    llm = engine(base, kv_offloading_size=0.05, kv_offloading_dir=str(tmp_path))
    assert answers(chat(llm, kind)) == answers(off)
    stats = llm.stats()
    assert stats["kv_offload_partial_stored_blocks"] > 0 and stats["kv_offload_partial_hit_tokens"] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_same_tokens_under_preemption(base, tmp_path, mode):
    """A 20-block pool runs six conversations at once only by preempting (swap: the loaded partial block moves
    to the host and back; recompute: it is loaded again, uncounted)."""
    off = engine(base, num_kv_blocks=20, preemption_mode=mode)
    on = engine(base, num_kv_blocks=20, preemption_mode=mode, kv_offloading_size=0.05,
                kv_offloading_dir=str(tmp_path))
    assert answers(chat(on, GREEDY, num_conversations=6)) == answers(chat(off, GREEDY, num_conversations=6))
    stats = on.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_offload_partial_hit_tokens"] > 0


def test_same_tokens_with_spec_decode(base, tmp_path):
    """[spec decode] n-gram proposals: a partial block is stored from the verified tokens only."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = engine(base, kv_offloading_dir=str(tmp_path), speculative_config=ngram)
    assert answers(chat(llm, GREEDY)) == answers(chat(engine(base, speculative_config=ngram), GREEDY))
    assert llm.stats()["kv_offload_partial_hit_tokens"] > 0


def test_tp2_same_tokens_with_partial_hits(tmp_path):
    """Tensor parallelism (full attention, one KV head per rank): each rank stores its shard of a partial block
    in its own disk tier and loads it only where every rank verified it; the tokens are TP=2's tier-off ones."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).eval()
    results = {}
    for name, kwargs in (("off", {}), ("on", {"kv_offloading_dir": str(tmp_path)})):
        llm = kvpage.LLM(model=copy.deepcopy(model), block_size=BLOCK, num_kv_blocks=24, max_num_batched_tokens=64,
                         swap_space_gib=0.001, tensor_parallel_size=2, **kwargs)
        try:
            if llm.llm_engine.kv_connector is not None:
                llm.llm_engine.kv_connector.recompute_seconds = None
            results[name] = answers(chat(llm, GREEDY, vocab=128)), llm.stats()
        finally:
            llm.shutdown()
    assert results["on"][0] == results["off"][0]
    assert results["on"][1]["kv_offload_partial_hit_tokens"] > 0


def test_leaves_the_last_prompt_token_to_compute(base):
    """A next prompt that is the whole last sequence: the partial entry (all but its last token, whose K/V
    was never computed) leaves exactly that token to compute; a prompt one token shorter cannot use it."""
    llm = engine(base, kv_offloading_size=0.05)
    prompt = [random.Random(3).randrange(100, 40000) for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    answer = list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
    whole = prompt + answer  # 19 tokens: blocks [0, 8), [8, 16), a partial of 2 computed tokens
    out = llm.generate([{"prompt_token_ids": whole}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == len(whole) - 1
    assert llm.stats()["kv_offload_partial_hit_tokens"] == 2
    off = engine(base)
    assert list(out.outputs[0].token_ids) == list(
        off.generate([{"prompt_token_ids": whole}], params, use_tqdm=False)[0].outputs[0].token_ids)
    shorter = llm.generate([{"prompt_token_ids": whole[:18]}], params, use_tqdm=False)[0]
    assert shorter.num_cached_tokens == 16 and llm.stats()["kv_offload_partial_hit_tokens"] == 2


def test_a_restart_finds_the_partial_block(base, tmp_path):
    """A new engine on the same directory: the start-up scan indexes the partial file too, so the next turn
    loads its tokens (the partial lookup reads only the index)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [random.Random(4).randrange(100, 40000) for _ in range(13)]
    first = engine(base, kv_offloading_dir=str(tmp_path))
    answer = list(first.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
    first.shutdown()
    follow = prompt + answer + [7, 8, 9, 10, 11]  # 24 tokens: 2 full blocks, then the 2-token partial
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    out = llm.generate([{"prompt_token_ids": follow}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 18 and llm.stats()["kv_offload_partial_hit_tokens"] == 2
    assert list(out.outputs[0].token_ids) == list(
        engine(base).generate([{"prompt_token_ids": follow}], params, use_tqdm=False)[0].outputs[0].token_ids)


def cache_rows(worker, block_id: int, num_tokens: int) -> list[torch.Tensor]:
    """The first num_tokens token rows of block_id in every cache tensor (copies)."""
    return [t[block_id][:, :num_tokens].clone() for t in worker._tensors]


def test_loaded_partial_rows_are_byte_exact(base, tmp_path):
    """The rows a partial block's tokens had when its sequence finished are the rows loaded into the next
    turn's fresh block, bit for bit; the stored payload's later rows are zero."""
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    e = llm.llm_engine
    connector, worker = e.kv_connector, e.runner
    finished, loaded = {}, []
    request_finished = connector.request_finished

    def record_finish(seq):
        i, n = divmod(seq.num_computed_tokens, BLOCK)
        if n:
            tokens = seq.token_ids[i * BLOCK:i * BLOCK + n]
            finished[pack_tokens(tokens)] = (cache_rows(worker, seq.block_tables[0][i], n),
                                             hashed_partial(seq.token_ids[:i * BLOCK], tokens))
        request_finished(seq)

    inner = worker._runner.execute

    def record_loads(batch):
        meta = batch.kv_connector_meta
        for (block_id, _), (_, key) in zip(meta.loads if meta else [], meta.load_keys if meta else []):
            n = len(key.token_bytes) // 8
            if n < BLOCK:
                loaded.append((key.token_bytes, cache_rows(worker, block_id, n)))
        return inner(batch)

    connector.request_finished = record_finish
    worker._runner.execute = record_loads
    chat(llm, GREEDY)
    assert loaded
    for token_bytes, rows in loaded:
        stored = finished[token_bytes][0]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(rows, stored))
    # A stored payload (read back whole): the valid rows, then zeros.
    connector.tier.flush()
    for rows, entry in finished.values():
        payload = connector.tier.get(*entry)
        assert payload is not None
        data, offset = bytes(payload), 0
        for t, want in zip(worker._tensors, rows):
            nbytes = t[0].numel() * t.element_size()
            block = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8).view(*t.shape[1:3], -1)
            n = want.shape[1]
            assert torch.equal(block[:, :n], want.contiguous().view(torch.uint8).view(*want.shape[:2], -1))
            assert not block[:, n:].any()
            offset += nbytes


def hashed_partial(prefix: list[int], tokens: list[int]):
    """(tier hash, key) of group 0's partial entry of `tokens` after the full blocks of `prefix`."""
    parent = ROOT_HASH
    for i in range(0, len(prefix), BLOCK):
        parent = hash_block_tokens(parent, prefix[i:i + BLOCK])
    return partial_entries(parent, pack_tokens(tokens), (), 1)[0]


def two_turns_with_damage(llm, damage) -> tuple[list, list]:
    """Turn 1, damage(path of its partial file), turn 2 (the same history plus new tokens): both answers."""
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
    whole = prompt + first
    connector = llm.llm_engine.kv_connector
    if connector is not None:
        connector.tier.flush()
        tier_hash, _ = hashed_partial(whole[:16], whole[16:18])
        damage(connector.tier._path(tier_hash))
    follow = whole + [rng.randrange(100, 40000) for _ in range(7)]
    out = llm.generate([{"prompt_token_ids": follow}], params, use_tqdm=False)[0]
    return [first, list(out.outputs[0].token_ids)], out.num_cached_tokens


def flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))


def flip_header(path: Path) -> None:
    """A flipped bit in the header's fingerprint: rejected at match time (another model's file)."""
    from kvpage.kv_offload.disk_tier import MAGIC
    data = bytearray(path.read_bytes())
    data[len(MAGIC)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [flip_payload, flip_header, lambda p: p.write_bytes(p.read_bytes()[:100])],
                         ids=["payload", "header", "truncated"])
def test_damaged_partial_file_is_skipped(base, tmp_path, caplog, damage):
    """A partial file damaged between turns is skipped with the disk tier's one warning and recomputed (a bad
    payload fails when loaded: KVLoadError, the step recomputed, nothing counted as a hit)."""
    reference, off_cached = two_turns_with_damage(engine(base), damage)
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        got, cached = two_turns_with_damage(llm, damage)
    assert got == reference
    assert any("skipping" in r.getMessage() for r in caplog.records)
    stats = llm.stats()
    assert stats["kv_offload_partial_hit_tokens"] == 0 and stats["kv_offload_rejected_blocks"] >= 1
    assert cached == off_cached == 16  # the two full blocks, from the pool


def test_no_partials_with_a_sliding_window():
    """A sliding-window group: the connector neither stores nor matches partial blocks, and the block manager
    takes only whole external blocks."""
    connector = OffloadingConnector(HostMemoryTier(2**20), BLOCK, sliding_windows=(None, 16))
    assert not connector.partial_blocks
    seq = Sequence(0, list(range(100, 121)))
    bm = BlockManager(32, BLOCK, kv_cache_layout=kv_cache_layout([None, 16]))
    with pytest.raises(ValueError, match="num_external_tokens"):
        bm.allocate(seq, 13, num_external_tokens=3)
    bm.allocate(seq, 13, num_external_tokens=8)
    seq.num_computed_tokens = 11
    connector.request_finished(seq)
    assert connector.build_connector_meta() is None
    full = BlockManager(32, BLOCK)
    other = Sequence(1, list(range(100, 121)))
    assert full.allocate(other, 21, num_external_tokens=11) == 0 and len(other.block_table) == 3
    with pytest.raises(ValueError, match="leaving its last token"):
        full.allocate(Sequence(2, list(range(100, 121))), 21, num_external_tokens=21)
