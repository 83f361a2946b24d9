"""vLLM's prompt dicts ({"prompt": text} / {"prompt_token_ids": ids}) and their cache_salt, which keeps
the prefix cache's blocks to requests of the same salt."""
from __future__ import annotations

import pytest

from engine_helpers import PROMPTS, make_llm
from kvpage import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
SHARED = PROMPTS[11]  # a long system prompt: several full blocks to hit


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_are_the_same_prompts(llm):
    text = PROMPTS[1]
    ids = llm.tokenizer.encode(text)
    want = llm.generate([text, ids], GREEDY, use_tqdm=False)
    got = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": text}],
                       GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(want)[:1] * 3
    assert [o.prompt for o in got] == [text, None, text] and all(o.prompt_token_ids == ids for o in got)
    single = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)  # one dict alone is one prompt
    assert _tokens(single) == _tokens(want)[:1]


def test_cache_salt_shares_blocks_only_within_a_salt(llm):
    eng = make_llm(llm)
    a1, b, a2, plain, plain2 = (eng.generate(p, GREEDY, use_tqdm=False)[0] for p in (
        {"prompt": SHARED, "cache_salt": "tenant-a"}, {"prompt": SHARED, "cache_salt": "tenant-b"},
        {"prompt": SHARED, "cache_salt": "tenant-a"}, SHARED, {"prompt": SHARED}))
    assert a1.num_cached_tokens == b.num_cached_tokens == plain.num_cached_tokens == 0
    assert a2.num_cached_tokens > 0 and plain2.num_cached_tokens == a2.num_cached_tokens
    assert len({tuple(o.outputs[0].token_ids) for o in (a1, b, a2, plain, plain2)}) == 1  # the salt changes nothing else
    beam = SamplingParams(beam_width=2, max_tokens=4)
    salted = eng.generate({"prompt": SHARED, "cache_salt": "tenant-c"}, beam, use_tqdm=False)[0]
    assert _tokens([salted]) == _tokens(eng.generate(SHARED, beam, use_tqdm=False))
    assert eng.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("prompt,match", [
    ({"text": "x"}, r"prompts\[\d\]"), ({}, r"prompts\[\d\]"), ({"prompt": 3}, r"prompts\[\d\]"),
    ({"prompt_token_ids": 5}, r"prompts\[\d\]"), ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt_token_ids": [1, 2], "cache_salt": 7}, "cache_salt"), ({"prompt_token_ids": []}, "prompt"),
])
def test_bad_prompt_dicts_are_refused_by_name(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[1], prompt], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=match):  # beam requests are checked before anything runs too
        llm.generate([prompt], SamplingParams(beam_width=2, max_tokens=2), use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_waiting"] == 0
