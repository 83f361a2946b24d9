"""docs/models.md's rows for the families without sliding windows: kvpage.LLM's greedy tokens equal HF generate's
on a tiny random model of each, on the path the table names (kvpage's own forward for the Llama family,
HF's modules with the "kvpage" attention function for the rest). The window families:
test_sliding_window_families.py."""
from __future__ import annotations

import pytest
import torch

import kvpage
from family_models import FAMILIES, FULL_FAMILIES, family_pair, random_prompts
from greedy_driver import hf_greedy
from kvpage.model import HFForward, ModelInput, ModelRunner, SequenceInput
from kvpage.model.llama import LlamaForward

OWNED_FORWARD = {"llama", "qwen2"}


@pytest.mark.parametrize("family", FULL_FAMILIES)
def test_greedy_matches_hf(family):
    reference, model = family_pair(family)
    prompts = random_prompts([31, 12, 20], seed=2)
    llm = kvpage.LLM(model=model, num_kv_blocks=32, block_size=8)
    assert isinstance(llm.runner.forward, LlamaForward if family in OWNED_FORWARD else HFForward)
    outputs = llm.generate(prompts, kvpage.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, prompts, 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_the_causal_lms_own(family):
    """The runner's logits of a 30-token prefill equal the HF model's forward: for the generic path that takes
    what the CausalLM does after its LM head (Gemma 2's final_logit_softcapping, Granite's logits_scaling),
    which sampling, penalties and logprobs read (greedy tokens alone would not see it)."""
    reference, model = family_pair(family)
    prompt = random_prompts([30], seed=4)[0]
    runner = ModelRunner(model, num_kv_blocks=8, block_size=8)
    slots = list(range(len(prompt)))  # blocks 0-3 in order
    logits = runner.execute(ModelInput([SequenceInput(prompt, 0, [0, 1, 2, 3], slots)]))
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
