"""Sampling parameters end to end: seeds, n > 1 sharing blocks, stop conditions, bad input, streaming."""
from __future__ import annotations

import pytest

import kvpage
from engine_helpers import PROMPTS, make_llm
from kvpage import SamplingParams

LONG = PROMPTS[11]  # ~60 tokens: four full blocks for the n samples to share


def test_seeded_parallel_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = make_llm(llm)
    first = alone.generate(LONG, params, use_tqdm=False)[0]
    stats = alone.stats()
    others = [SamplingParams(temperature=1.0, max_tokens=20)] * 4 + [params]
    batched = llm.generate(PROMPTS[:4] + [LONG], others, use_tqdm=False)[-1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in batched.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # four different samples
    assert all(c.cumulative_logprob < 0 for c in first.outputs)
    # Blocks shared: the prompt's blocks once, plus a private tail per sample (copy-on-write), not
    # four copies of the prompt.
    prompt_blocks = len(first.prompt_token_ids) // 16
    assert stats["max_kv_blocks_used"] < 4 * prompt_blocks, stats
    assert stats["num_copy_on_write"] > 0, stats


def test_different_seeds_differ(llm):
    a, b = (llm.generate(LONG, SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0] for s in (1, 2))
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_greedy_n_and_temperature_zero_agree(llm):
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    top1 = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=3),
                        use_tqdm=False)[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert top1.outputs[0].cumulative_logprob == pytest.approx(greedy.outputs[0].cumulative_logprob, abs=1e-3)


def test_stop_strings_tokens_and_length(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop = base.text[10:14]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[stop, "never"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[:base.text.index(stop)]
    assert cut.token_ids == base.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 24
    stop_id = base.token_ids[5]
    by_id = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]


def test_eos_and_ignore_eos(llm):
    chat = [{"role": "user", "content": "What is 2+2?"}]
    ended = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = llm.tokenizer.eos_token_id
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == eos
    assert "4" in ended.text
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=len(ended.token_ids) + 3, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert longer.finish_reason == "length" and len(longer.token_ids) == len(ended.token_ids) + 3
    assert longer.token_ids[:len(ended.token_ids)] == ended.token_ids


@pytest.mark.parametrize("name,value", [
    ("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", 0),
    ("stop", [""]), ("stop_token_ids", [-1]), ("beam_width", 0), ("seed", "x"), ("ignore_eos", "yes"),
    ("length_penalty", float("nan")), ("length_penalty", float("inf")), ("length_penalty", float("-inf")),
    ("stop", 123), ("stop", 3.5), ("stop", True), ("stop", object()), ("stop", ["ok", 5]),
    ("stop_token_ids", 5), ("stop_token_ids", "12"), ("stop_token_ids", [1, True]),
])
def test_bad_sampling_params_name_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_bad_llm_arguments():
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # TP itself: tests/distributed
        kvpage.LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        kvpage.LLM(num_kv_blocks=0)


@pytest.mark.parametrize("name,value", [
    ("block_size", 0), ("block_size", -16), ("block_size", "16"), ("block_size", 16.0), ("block_size", True),
    ("block_size", 24), ("block_size", 512), ("seed", "x"), ("seed", 1.5), ("seed", True), ("seed", 2**64),
    ("enable_prefix_caching", "no"), ("enable_prefix_caching", 1), ("tokenizer", 42), ("tokenizer", object()),
    ("tokenizer", "/no/such/tokenizer"), ("preemption_mode", "later"), ("swap_space_gib", float("inf")),
    ("swap_space_gib", float("nan")), ("swap_space_gib", True), ("swap_space_gib", -1), ("dtype", "bogus"),
])
def test_bad_llm_arguments_are_named_before_the_model_loads(monkeypatch, name, value):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(kvpage.model, "load_model", load_model)
    with pytest.raises((ValueError, TypeError), match=name):
        kvpage.LLM(**{name: value})


def test_a_tokenizer_directory_and_other_block_sizes_work(llm):
    from kvpage.model.loader import default_model_dir

    expected = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    for kwargs in ({"tokenizer": str(default_model_dir())}, {"block_size": 1}, {"block_size": 256}):
        other = kvpage.LLM(model=llm.model, num_kv_blocks=64, **{"tokenizer": llm.tokenizer, **kwargs})
        got = other.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text) == (expected.token_ids, expected.text), kwargs


def test_too_long_prompt_fails_alone(llm):
    small = make_llm(llm, num_kv_blocks=8)  # 128 tokens of cache
    engine = small.llm_engine
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.add_request("long", PROMPTS[14] * 4, SamplingParams(max_tokens=8))
    engine.add_request("b", PROMPTS[3], SamplingParams(temperature=0, max_tokens=8))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["a", "b"]
    # generate() checks every prompt before running any, names the culprit, and leaves the engine usable.
    with pytest.raises(ValueError, match="prompt 1"):
        small.generate([PROMPTS[1], PROMPTS[14] * 4], SamplingParams(max_tokens=8), use_tqdm=False)
    again = small.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == done["a"].outputs[0].token_ids
    assert small.stats()["kv_blocks_used"] == 0


def test_streaming_step_outputs_are_incremental(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("stream", PROMPTS[4], params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "stream"]
    assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 11))
    assert seen[-1].finished and not seen[0].finished
    final = llm.generate(PROMPTS[4], params, use_tqdm=False)[0].outputs[0]
    assert seen[-1].outputs[0].text == final.text and final.text.startswith(seen[4].outputs[0].text)
    assert seen[-1].metrics["ttft"] > 0


def test_text_is_the_decode_of_the_tokens_with_or_without_stop_strings_or_streaming(llm):
    """An output that ends inside a multi-byte character: the incremental detokenizer (stop strings,
    streaming) holds that character back while it waits for its other bytes; at the end its text is
    still the whole decode, U+FFFD included, as without stop strings."""
    prompt = "日本語で自己紹介してください。"  # greedy output splits characters across tokens
    tokenizer = llm.get_tokenizer()
    lengths = range(1, 13)
    for stop in (None, ["never-in-output"]):
        outs = llm.generate([prompt] * len(lengths), [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True,
                                                                     stop=stop) for k in lengths], use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        assert texts == [tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]
        assert any(t.endswith("\ufffd") for t in texts)  # the case in question did occur
    engine = llm.llm_engine
    engine.add_request("stream", prompt, SamplingParams(temperature=0, max_tokens=lengths[-1], ignore_eos=True))
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [o for o in engine.step() if o.request_id == "stream"]
    assert streamed[-1].finished and streamed[-1].outputs[0].text == texts[-1]


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("x", PROMPTS[11], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert llm.stats()["kv_blocks_used"] == 0

