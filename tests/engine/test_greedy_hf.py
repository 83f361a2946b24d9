"""Greedy output token-identical to HF generate (fp32), under every scheduling regime the engine has."""
from __future__ import annotations

import copy

import pytest
import torch

import kvpage
from kvpage import SamplingParams

from engine_helpers import GREEDY, PROMPTS, assert_greedy_matches, hf_generate, make_llm


def test_default_model_matches_hf(llm, hf_greedy):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(o.finished for o in outputs)
    assert_greedy_matches(outputs, hf_greedy)
    assert llm.stats()["kv_blocks_used"] == 0  # everything finished and freed
    # Asked again, the prompts come from the prefix cache (all but their last token) and agree.
    again = llm.generate(PROMPTS[8:12], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs[8:12]]
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_identical_block_aligned_prompts_share_every_block(llm, hf_model, prompt_ids):
    # A 48-token prompt (3 full blocks) sent 6 times in one batch: the first computes it, and the
    # rest, in the same step, hit the 3 blocks it is writing and compute only the last token (for
    # its logits): one prefill step, then 7 decode steps.
    prompt = [t for ids in prompt_ids for t in ids][:48]  # block_size 16
    engine = make_llm(llm)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    steps = engine.llm_engine.num_steps
    outputs = engine.generate([prompt] * 6, params, use_tqdm=False)
    assert_greedy_matches(outputs, hf_generate(hf_model, [prompt], 8) * 6)
    assert engine.stats()["prefix_cache_hit_tokens"] == 5 * (len(prompt) - 1)
    assert [o.num_cached_tokens for o in outputs] == [0] + [len(prompt) - 1] * 5
    assert engine.llm_engine.num_steps - steps == 8


# A budget of 32 tokens chunks every long prompt; 16 blocks (256 tokens) cannot hold the batch's
# ~1,800 tokens, so requests are preempted and resumed, by swap or by recompute.
CONFIGS = {
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "preempt_swap": dict(num_kv_blocks=16, preemption_mode="swap"),
    "preempt_recompute": dict(num_kv_blocks=16, preemption_mode="recompute", max_num_batched_tokens=64),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_configs_match_hf(llm, hf_greedy, name):
    engine = make_llm(llm, **CONFIGS[name])
    outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches(outputs, hf_greedy)
    stats = engine.stats()
    if name.startswith("preempt"):
        assert stats["num_preemptions"] > 0, stats
        mode = name.removeprefix("preempt_")
        assert stats[f"num_{mode}_preemptions"] == stats["num_preemptions"], stats
        if mode == "swap":
            assert stats["num_swapped_out_blocks"] > 0 and stats["num_swapped_in_blocks"] > 0
    if name == "no_prefix_caching":
        assert stats["prefix_cache_hit_tokens"] == 0


@pytest.fixture(scope="module")
def qwen2():
    """A tiny random Qwen2 (a second model family: biased q/k/v projections, its own rotary setup)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None  # random weights: no meaningful end token
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 5, 16, 17, 33, 40, 64, 90)]
    prompts.append(prompts[6][:48] + [7, 8, 9])  # shares three full blocks with another prompt
    return model, prompts, hf_generate(reference, prompts, 20)


@pytest.mark.parametrize("kwargs", [dict(), dict(enable_prefix_caching=False, max_num_batched_tokens=24),
                                    dict(num_kv_blocks=12, preemption_mode="swap"),
                                    dict(num_kv_blocks=12, preemption_mode="recompute")],
                         ids=["default", "chunked_no_prefix", "preempt_swap", "preempt_recompute"])
def test_second_family_qwen2_matches_hf(qwen2, kwargs):
    model, prompts, refs = qwen2
    kwargs.setdefault("num_kv_blocks", 256)
    engine = kvpage.LLM(model=model, **kwargs)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert all(o.outputs[0].text == "" for o in outputs)  # no tokenizer: token ids only
    assert_greedy_matches(outputs, refs)
    if "preemption_mode" in kwargs:
        assert engine.stats()["num_preemptions"] > 0
