"""Models with sliding-window layers, logit softcapping and attention sinks at their full context: greedy tokens
identical to HF generate on eager attention (which applies the window, softcap and sinks as each model
defines them) for Gemma 2, Gemma 3, Mistral, Qwen2 with use_sliding_window and gpt-oss, with prompts and
outputs several windows long; through the runner with chunked prefill, prefix-cache hits, forks (n > 1)
and swaps, and through kvpage.LLM with beam search and both preemption modes.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface

import kvpage
from greedy_driver import assert_same_greedy, hf_greedy, run_greedy
from kvpage import SamplingParams
from kvpage.core import num_blocks_per_seq
from kvpage.engine.model_config import layer_sliding_windows
from kvpage.model import HFForward, ModelInput, ModelRunner, SequenceInput
from kvpage.model.llama import LlamaForward
from kvpage.model.runner import model_kv_cache_layout
from family_models import WINDOW_FAMILIES, family_model, family_pair, random_prompts

# Each family's block size: windows of 12-20 tokens end mid-block in some, on a block boundary in others.
BLOCK_SIZES = {"gemma2": 8, "gemma3": 8, "mistral": 16, "qwen2_sliding": 8, "gpt_oss": 16}
OWNED_FORWARD = {"mistral", "qwen2_sliding"}  # Llama-family: kvpage's own forward; the rest: HF's modules
NEW_TOKENS = 40


def _runner(model, family: str, num_kv_blocks: int = 96, **kwargs) -> ModelRunner:
    """The model's own KV-cache groups: window groups' tables hold NULL_BLOCK before each window."""
    return ModelRunner(model, num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZES[family],
                       kv_cache_layout=model_kv_cache_layout(model.config), **kwargs)


@pytest.fixture(scope="module", params=WINDOW_FAMILIES)
def family_case(request):
    """(family, reference model, kvpage model, prompts, HF's greedy tokens) once per family."""
    family = request.param
    reference, model = family_pair(family)
    prompts = random_prompts([50, 37, 9, 23])
    return family, reference, model, prompts, hf_greedy(reference, prompts, NEW_TOKENS)


def _window_kwargs_hf_passes(model) -> list[int | None]:
    """Each layer's sliding window as HF's modules hand it to the attention function in a forward pass."""
    seen = {}

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        return query.transpose(1, 2).contiguous(), None  # the layout attention returns; values do not matter

    AttentionInterface.register("window_spy", spy)
    model = copy.deepcopy(model)
    model.set_attn_implementation("window_spy")
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]))
    return [seen[i] for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_layer_sliding_windows_are_what_hfs_layers_attend_within(family):
    model = family_model(family)
    windows = layer_sliding_windows(model.config)
    assert windows == _window_kwargs_hf_passes(model)
    assert any(w is not None for w in windows)


def test_every_family_runs_at_max_position_embeddings():
    """No cap at the window any more: the context is the model's own."""
    for family in WINDOW_FAMILIES:
        model = family_model(family)
        llm = kvpage.LLM(model=model, num_kv_blocks=8, block_size=16)
        assert llm.llm_engine.config.max_model_len == model.config.max_position_embeddings == 2048


def test_greedy_matches_hf_past_the_window(family_case):
    """Prompts of up to 50 tokens and 40 more generated: every sequence outgrows a 12-20 token window
    several times over, in one step's prefill and then token by token. The blocks windows dropped are
    NaN from then on: no kernel reads them."""
    family, _, model, prompts, expected = family_case
    runner = _runner(model, family)
    assert isinstance(runner.forward, LlamaForward if family in OWNED_FORWARD else HFForward)
    assert runner.layout.is_hybrid
    run = run_greedy(runner, prompts, NEW_TOKENS, arrivals=[0, 0, 3, 7], poison_free_blocks=True)
    assert assert_same_greedy(run, expected) == 0


def test_chunked_prefill_prefix_hits_forks_and_swaps_keep_hfs_tokens(family_case):
    """Chunks of 12 tokens (prefills cut mid-window, mixed with decodes), prompts sharing a 32-token prefix
    (cache hits), a fork into two children (n > 1: copy-on-write), a sequence swapped out and back."""
    family, reference, model, prompts, _ = family_case
    shared = prompts[0][:32]
    sharing = [shared + p[:10] for p in prompts[1:]] + [prompts[0]]
    expected = hf_greedy(reference, sharing, 24)
    runner = _runner(model, family, num_host_blocks=32)
    run = run_greedy(runner, sharing, 24, arrivals=[0, 4, 4, 9], token_budget=12, enable_prefix_caching=True,
                     forks={1: 2}, swap_out={14: 0})
    assert run.mixed_steps and run.num_swapped and run.num_copies
    assert run.block_manager.stats().prefix_cache_hit_tokens > 0
    assert assert_same_greedy(run, expected + [expected[1]] * 2) == 0


# -- through kvpage.LLM ----------------------------------------------------------------------------------


def _llm(model, family: str, **kwargs) -> kvpage.LLM:
    kwargs.setdefault("num_kv_blocks", 96)
    return kvpage.LLM(model=model, block_size=BLOCK_SIZES[family], seed=0, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_small_pool_keeps_hfs_tokens(family_case, mode):
    """A pool one and a half times what the longest sequence may hold (over every KV-cache group): the four
    cannot all run at once, so some are preempted (recomputed, or swapped to the host) and resume past their
    windows with HF's tokens; seeded sampling with n = 2 rides along and gives what it gives with room to
    spare."""
    family, _, model, prompts, expected = family_case
    block_size = BLOCK_SIZES[family]
    longest = max(len(p) for p in prompts)
    need = num_blocks_per_seq(model_kv_cache_layout(model.config), longest + NEW_TOKENS, block_size, longest)
    sampled = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    roomy = _llm(model, family).generate(prompts[2:3], sampled, use_tqdm=False)[0]
    small = _llm(model, family, num_kv_blocks=need * 3 // 2, preemption_mode=mode, swap_space_gib=0.01,
                 enable_prefix_caching=False)
    outs = small.generate(prompts + prompts[2:3], [GREEDY] * len(prompts) + [sampled], use_tqdm=False)
    stats = small.stats()
    assert stats["num_preemptions"] > 0, stats
    assert [o.outputs[0].token_ids for o in outs[:-1]] == expected
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in roomy.outputs]
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", ["gemma2", "mistral", "gpt_oss"])
def test_beam_search_matches_hf(family):
    reference, model = family_pair(family)
    prompts = random_prompts([30, 21], seed=5)
    k, new = 3, 24
    llm = _llm(model, family)
    outputs = llm.generate(prompts, SamplingParams(beam_width=k, max_tokens=new, ignore_eos=True), use_tqdm=False)
    reference.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=k,
                                     num_return_sequences=k, max_new_tokens=new)
        assert [c.token_ids for c in out.outputs] == ref[:, len(prompt):].tolist()
    assert llm.stats()["kv_blocks_used"] == 0


def test_what_the_kernels_cannot_compute_is_refused_by_name():
    """A layer type without a kernel (Llama 4's chunked attention), bidirectional attention (Gemma 3's
    use_bidirectional_attention), a layer whose own window is not its config's (the KV-cache groups would
    free blocks it reads), sinks that are not one per query head: refused before any step runs."""
    chunked = family_model("qwen2_sliding")
    chunked.config.layer_types = ["full_attention", "chunked_attention", "sliding_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        ModelRunner(chunked, num_kv_blocks=8)
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        ModelRunner(family_model("gemma3", use_bidirectional_attention=True), num_kv_blocks=8)
    mismatched = family_model("gemma2")
    mismatched.model.layers[1].self_attn.sliding_window = 16  # a full-attention layer by its config
    with pytest.raises(NotImplementedError, match="layer 1 attends within a window of 16, its config says None"):
        ModelRunner(mismatched, num_kv_blocks=8)
    gpt_oss = family_model("gpt_oss")
    gpt_oss.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(3))
    runner = ModelRunner(gpt_oss, num_kv_blocks=8, block_size=16)  # one full group: one table per sequence
    with pytest.raises(ValueError, match=r"one per query head \(4,\)"):
        runner.execute(ModelInput([SequenceInput([5, 6, 7], 0, [0], [0, 1, 2])]))
