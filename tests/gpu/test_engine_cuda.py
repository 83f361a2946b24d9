"""kvpage.LLM and the HF drop-in (PagedCache) on a GPU, against HF on the same device and dtype.

Each test runs on "cpu" as well as "cuda": CI has no GPU, so the CPU cases prove the test code itself
(and the engine's device handling wherever a CPU can show it); the CUDA cases skip without one and
bench/gpu_check.sh runs them on the lent GPU. On CUDA the engine's decode steps replay CUDA graphs
unless enforce_eager (kvpage.model.cuda_graphs).
"""
from __future__ import annotations

import math

import pytest
import torch

import kvpage
from engine_helpers import BF16_TIE_TOLERANCE, TIE_TOLERANCE, assert_greedy_matches, hf_generate
from hf_helpers import generate_both, left_padded
from kvpage import SamplingParams
from tiny_models import model_pair, random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_check.sh runs it)")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16 on the GPU only: on a CPU it runs the same test code as fp32, four times slower (CI's time).
DEVICE_DTYPES = [("cpu", "fp32"), pytest.param("cuda", "fp32", marks=needs_cuda),
                 pytest.param("cuda", "bf16", marks=needs_cuda)]
TIES = {torch.float32: TIE_TOLERANCE, torch.bfloat16: BF16_TIE_TOLERANCE}
MAX_NEW = 16
# Graph buckets 1, 2, 4, 8, 16: every batch these tests make fits one, and capture stays quick.
MAX_NUM_SEQS = 16
# 12 blocks of 16 cannot hold the ~500 tokens of the nine requests: they are preempted and resumed.
CONFIGS = {
    "default": dict(),
    "chunked_no_prefix": dict(enable_prefix_caching=False, max_num_batched_tokens=24),
    "preempt_swap": dict(num_kv_blocks=12, preemption_mode="swap"),
    "preempt_recompute": dict(num_kv_blocks=12, preemption_mode="recompute"),
}
_CASES: dict = {}


def _prompts() -> list[list[int]]:
    prompts = random_prompts([1, 5, 16, 17, 33, 40, 64, 90])
    return prompts + [prompts[6][:48] + [7, 8, 9]]  # shares three full blocks with prompts[6]


def _case(family: str, dtype: torch.dtype, device: str):
    """(model for kvpage, prompts, HF greedy references): built once per family, dtype and device."""
    key = (family, dtype, device)
    if key not in _CASES:
        reference, model = (m.to(device, dtype) for m in model_pair(family))
        prompts = _prompts()
        _CASES[key] = model, prompts, hf_generate(reference, prompts, MAX_NEW)
    return _CASES[key]


def _llm(model, **kwargs) -> kvpage.LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return kvpage.LLM(model=model, max_num_seqs=MAX_NUM_SEQS, **kwargs)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf(device, dtype, family, config):
    model, prompts, refs = _case(family, DTYPES[dtype], device)
    engine = _llm(model, **CONFIGS[config])
    assert (engine.runner.graphs is not None) == (device == "cuda")  # graphs are the GPU's default
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert_greedy_matches(outputs, refs, tie_tolerance=TIES[DTYPES[dtype]])
    stats = engine.stats()
    if config.startswith("preempt"):
        mode = config.removeprefix("preempt_")
        assert stats[f"num_{mode}_preemptions"] > 0, stats
        if mode == "swap":  # through pinned host memory on a GPU: asynchronous DMA, not pageable copies
            assert stats["num_swapped_in_blocks"] > 0
            assert engine.runner.host_kv_caches[0][0].is_pinned() == (device == "cuda")
    if config == "default":
        assert stats["prefix_cache_hit_tokens"] >= 48
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_graph_and_eager_steps_agree(device):
    """The same requests with and without CUDA graphs (eager on a CPU either way): the same tokens, and
    log-probabilities equal up to the padding rows' GEMM shapes (a graph runs its whole bucket)."""
    model, prompts, _ = _case("llama", torch.float32, device)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1)
    graphs, eager = (_llm(model, enforce_eager=e).generate(prompts, params, use_tqdm=False) for e in (False, True))
    for a, b in zip(graphs, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        expected = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=TIE_TOLERANCE, rtol=0)


def _teacher_forced_logprob(reference, prompt: list[int], tokens: list[int]) -> float:
    """HF's log-probability of `tokens` after `prompt`, one forward pass over both."""
    x = torch.tensor([prompt + tokens], device=reference.device)
    with torch.inference_mode():
        logp = reference(x).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    return logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).sum().item()


@pytest.mark.parametrize("device", DEVICES)
def test_n_samples_are_real_continuations(device):
    """n > 1 forks share the prompt's blocks: each sample's cumulative_logprob is what HF's model gives its
    tokens, and seeded samples are reproducible (on a second engine: no prefix-cache hits to change a logit)."""
    reference, model = (m.to(device) for m in model_pair("qwen2"))
    prompts = _prompts()[2:6]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    outputs, again = (_llm(model).generate(prompts, params, use_tqdm=False) for _ in range(2))
    for prompt, out, out2 in zip(prompts, outputs, again):
        assert len(out.outputs) == 3
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in out2.outputs]
        for c in out.outputs:
            expected = _teacher_forced_logprob(reference, prompt, c.token_ids)
            assert math.isclose(c.cumulative_logprob, expected, abs_tol=1e-3), (c, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_matches_hf(device, k):
    reference, model = (m.to(device) for m in model_pair("llama"))
    prompts = _prompts()[1:5]
    outputs = _llm(model).generate(prompts, SamplingParams(beam_width=k, max_tokens=10), use_tqdm=False)
    pad = reference.generation_config.pad_token_id
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=k,
                                     num_return_sequences=k, max_new_tokens=10)
        assert len(out.outputs) == k
        for beam, completion in zip(ref[:, ids.shape[1]:].tolist(), out.outputs):
            got = completion.token_ids
            assert beam[:len(got)] == got and all(t == pad for t in beam[len(got):]), (prompt, beam, got)


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_match_hf(device):
    reference, model = (m.to(device) for m in model_pair("llama"))
    prompts = _prompts()[3:6]
    outputs = _llm(model).generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            logp = reference(torch.tensor([prompt], device=device)).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        got = [entries[t].logprob for entries, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        expected = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor(got), expected.cpu(), atol=5e-4, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_paged_cache_greedy_matches_dynamic_cache(device, family):
    model, _ = model_pair(family)
    model.to(device)
    ids, mask = (t.to(device) for t in left_padded(random_prompts([37, 5, 90, 1, 16, 17], seed=3), pad_id=0))
    pair = generate_both(model, ids, mask, cache_kwargs=dict(block_size=8), do_sample=False, max_new_tokens=16,
                         min_new_tokens=16, pad_token_id=0)
    assert torch.equal(pair.paged, pair.reference)
    assert pair.cache.kv_caches[0][0].device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_paged_cache_beam_search_matches_dynamic_cache(device):
    model, _ = model_pair("qwen2")
    model.to(device)
    ids, mask = (t.to(device) for t in left_padded(random_prompts([21, 6, 40], seed=7), pad_id=0))
    pair = generate_both(model, ids, mask, cache_kwargs=dict(block_size=8), do_sample=False, num_beams=3,
                         num_return_sequences=3, max_new_tokens=12, pad_token_id=0, return_dict_in_generate=True,
                         output_scores=True)
    assert torch.equal(pair.paged.sequences, pair.reference.sequences)
    torch.testing.assert_close(pair.paged.sequences_scores, pair.reference.sequences_scores, rtol=1e-4, atol=1e-4)
    assert pair.cache.stats().num_copy_on_write > 0  # beams shared blocks, then wrote into them
