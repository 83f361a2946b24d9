"""Beam search against HF generate(num_beams=k, do_sample=False), default early_stopping."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import PROMPTS
from kvpage import SamplingParams

BEAM_PROMPTS = [PROMPTS[1], PROMPTS[4], PROMPTS[13], PROMPTS[9]]


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.5)])
def test_beam_search_matches_hf(llm, hf_model, k, length_penalty):
    params = SamplingParams(beam_width=k, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.generate(BEAM_PROMPTS, params, use_tqdm=False)
    pad = hf_model.generation_config.pad_token_id
    for prompt, out in zip(BEAM_PROMPTS, outputs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=k,
                                    num_return_sequences=k, max_new_tokens=10, length_penalty=length_penalty)
        assert len(out.outputs) == k
        for beam, completion in zip(ref[:, ids.shape[1]:].tolist(), out.outputs):
            got = completion.token_ids
            assert beam[:len(got)] == got and all(t == pad for t in beam[len(got):]), (prompt, beam, got)
    assert llm.stats()["kv_blocks_used"] == 0
