"""What the engine does with a request's parameters, whichever door it came in by (issue 49, findings 4
and 5, and finding 7's LLM half): n refused before n samples are built, the caller's SamplingParams
copied when the request is added, an allowed set that the request's own options mask entirely refused,
a broken chat template a ValueError, an assistant message without content accepted, and no internal
request id in an error."""
from __future__ import annotations

import pytest

import kvpage.engine.request_intake as request_intake
from kvpage import SamplingParams
from kvpage.engine.logits_processors import BANNING_BIAS


def test_n_is_refused_before_its_samples_are_built(offline, monkeypatch):
    built = []
    real = request_intake.SampleState
    monkeypatch.setattr(request_intake, "SampleState", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=r"n=1000000 exceeds max_num_seqs"):
        offline.generate("Hi", SamplingParams(n=10**6), use_tqdm=False)
    assert not built
    assert len(offline.generate("Hi", SamplingParams(n=2, max_tokens=2), use_tqdm=False)[0].outputs) == 2


def test_the_callers_params_are_copied_when_the_request_is_added(offline):
    """Changing the SamplingParams after add_request (another thread, between steps) reaches nothing."""
    want = offline.generate("Hi there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = offline.llm_engine
    engine.add_request("copied", "Hi there", params)
    outputs = []
    try:
        outputs += engine.step()
        params.allowed_token_ids = [7]  # would half-apply: only later tokens forced to 7
        params.max_tokens = 1
        params.temperature = None  # would fail a step
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        engine.abort_request("copied")
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == want


@pytest.mark.parametrize("options", [
    dict(allowed_token_ids=[5], bad_words="bad word"),  # the word's token: set in the test
    dict(allowed_token_ids=[5, 6], logit_bias={5: -3.4e38, 6: BANNING_BIAS}),
    dict(allowed_token_ids=[5], logit_bias={5: -3.4028234663852886e38}, temperature=0),
], ids=["bad_words", "logit_bias", "logit_bias-greedy"])
def test_an_allowed_set_masked_entirely_is_refused_at_add_time(offline, tok, options):
    if "bad_words" in options:
        options = {**options, "bad_words": [tok.decode([5])]}
        assert tok.encode(options["bad_words"][0], add_special_tokens=False) == [5]
    engine = offline.llm_engine
    with pytest.raises(ValueError, match="allowed_token_ids: every one of them .* no token is left to sample"):
        offline.generate("Hi", SamplingParams(max_tokens=3, **options), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    # One allowed token left unbanned: it is the only one sampled.
    allowed = options["allowed_token_ids"] + [9]
    out = offline.generate("Hi", SamplingParams(max_tokens=3, **{**options, "allowed_token_ids": allowed}),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [9, 9, 9]


def test_a_bias_above_the_ban_is_not_a_ban(offline):
    out = offline.generate("Hi", SamplingParams(max_tokens=2, allowed_token_ids=[5], logit_bias={5: -1e30}),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [5, 5]


def test_errors_name_the_prompt_not_the_internal_request_id(model, tok):
    from server_helpers import make_llm
    llm = make_llm(model, tok, num_kv_blocks=64)
    try:
        with pytest.raises(ValueError) as refused:
            llm.generate(["Hi", "Ho"], [SamplingParams(), SamplingParams(n=100)], use_tqdm=False)
        assert str(refused.value).startswith("prompt 1: prompt of 1 tokens + max_tokens=16 (n=100) needs")
        assert "request" not in str(refused.value)
    finally:
        llm.shutdown()


def test_a_broken_chat_template_is_a_value_error(offline):
    user = [{"role": "user", "content": "Hi"}]
    for template in ("{% for %}", "{{ raise_exception('no system message') }}"):
        with pytest.raises(ValueError, match="^chat_template: Template"):
            offline.chat(user, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template)


CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant"}, {"role": "user", "content": "Go on"}]


def test_an_assistant_message_without_content_is_accepted_as_openai_does(offline):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    no_key = offline.chat(CONVERSATION, greedy, use_tqdm=False)[0]
    none = offline.chat([{**m, "content": m.get("content")} for m in CONVERSATION], greedy, use_tqdm=False)[0]
    empty = offline.chat([{**m, "content": m.get("content", "")} for m in CONVERSATION], greedy, use_tqdm=False)[0]
    assert no_key.prompt_token_ids == none.prompt_token_ids == empty.prompt_token_ids
    assert no_key.outputs[0].token_ids == empty.outputs[0].token_ids
    assert "content" not in CONVERSATION[1]  # the caller's messages are left as they were
    for message in ({"role": "user"}, {"role": "user", "content": None}, {"role": "system"}):
        with pytest.raises(ValueError, match=r"messages\[0\]: content must be a string"):
            offline.chat([message], greedy, use_tqdm=False)
