"""logit_bias, allowed_token_ids and bad_words against HF generate's own processors (sequence_bias,
prefix_allowed_tokens_fn, bad_words_ids), and skip_special_tokens, truncate_prompt_tokens and num_cached_tokens."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import PROMPTS, assert_greedy_matches, hf_generate, make_llm
from kvpage import SamplingParams
from kvpage.engine.logits_processors import apply_bad_words, bad_words_token_ids


def test_greedy_logit_bias_matches_hf_sequence_bias(llm, hf_model, hf_greedy, prompt_ids):
    picks = [1, 4, 13]
    # Push each prompt's second greedy token down and a rarely chosen token up: the output must change.
    bias = {hf_greedy[i][0][1]: -6.0 for i in picks} | {llm.tokenizer.encode(" banana")[0]: 3.0}
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias=bias)
    outs = llm.generate([prompt_ids[i] for i in picks], params, use_tqdm=False)
    refs = hf_generate(hf_model, [prompt_ids[i] for i in picks], 12, processed=True,
                       sequence_bias=[[[t], b] for t, b in bias.items()])
    assert_greedy_matches(outs, refs)
    assert all(o.outputs[0].token_ids != hf_greedy[i][0][:12] for o, i in zip(outs, picks))


def test_greedy_allowed_token_ids_match_hf_prefix_allowed_tokens_fn(llm, hf_model, prompt_ids):
    allowed = sorted({t for word in (" yes", " no", " maybe", ".", "!") for t in llm.tokenizer.encode(word)})
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)
    picks = [1, 8]
    outs = llm.generate([prompt_ids[i] for i in picks], params, use_tqdm=False)
    refs = hf_generate(hf_model, [prompt_ids[i] for i in picks], 8, processed=True,
                       prefix_allowed_tokens_fn=lambda batch_id, ids: allowed)
    assert_greedy_matches(outs, refs)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    sampled = llm.generate(PROMPTS[1], SamplingParams(temperature=1.2, seed=1, n=4, max_tokens=8,
                                                      allowed_token_ids=allowed), use_tqdm=False)[0]
    assert all(set(c.token_ids) <= set(allowed) for c in sampled.outputs)


def test_skip_special_tokens_false_keeps_eos_in_the_text(llm):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                             add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    greedy = dict(temperature=0, max_tokens=32)
    for stream_stop in (None, "never-in-the-text"):  # decoded at the end, and incrementally (stop strings)
        plain, kept = llm.generate([ids, ids], [SamplingParams(**greedy, stop=stream_stop),
                                                SamplingParams(**greedy, stop=stream_stop, skip_special_tokens=False)],
                                   use_tqdm=False)
        assert plain.outputs[0].token_ids == kept.outputs[0].token_ids
        assert plain.outputs[0].token_ids[-1] == llm.tokenizer.eos_token_id  # it did end on eos
        eos_text = llm.tokenizer.eos_token
        assert eos_text not in plain.outputs[0].text and kept.outputs[0].text == plain.outputs[0].text + eos_text


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, prompt_ids):
    long = prompt_ids[11]
    params = SamplingParams(temperature=0, max_tokens=6)
    cut = llm.generate([long], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=10),
                       use_tqdm=False)[0]
    tail = llm.generate([long[-10:]], params, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate([long], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=len(long) + 5),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == long


def test_num_cached_tokens_counts_the_prefix_cache_hit(llm):
    eng = make_llm(llm)
    prompt = PROMPTS[11]
    first = eng.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    before = eng.stats()["prefix_cache_hit_tokens"]
    second = eng.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == eng.stats()["prefix_cache_hit_tokens"] - before > 0


def test_token_ids_outside_the_vocabulary_are_refused_at_add_request(llm):
    vocab = llm.runner.vocab_size
    for params in (SamplingParams(logit_bias={vocab: 1.0}), SamplingParams(allowed_token_ids=[1, vocab + 3])):
        with pytest.raises(ValueError, match="logit_bias|allowed_token_ids"):
            llm.generate(PROMPTS[1], params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_waiting"] == 0


def test_a_string_prompt_whose_token_ids_the_model_cannot_embed_is_refused(llm):
    """Another model's tokenizer: its ids would index past the embedding mid-step (a device assert on
    CUDA); refused by name at add_request, and the engine runs on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvpage

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    small = kvpage.LLM(model=model, tokenizer=llm.get_tokenizer(), num_kv_blocks=16)
    with pytest.raises(ValueError, match="prompt 0: the tokenizer gives this prompt token ids .* vocab_size=128"):
        small.generate("Hello there, how are you?", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(small.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert small.stats()["kv_blocks_used"] == 0


def test_min_tokens_with_nothing_but_stop_tokens_to_sample_is_refused(llm):
    """min_tokens holds back every stop token; with nothing else allowed no token could come out (the
    row would be all -inf), so the request is refused at add_request instead of sampling garbage."""
    eos = llm.llm_engine.config.eos_token_ids[0]
    vocab = llm.runner.vocab_size
    for params in (SamplingParams(min_tokens=2, max_tokens=4, allowed_token_ids=[eos]),
                   SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=list(range(vocab)))):
        with pytest.raises(ValueError, match="min_tokens=2: every token the request may sample"):
            llm.generate(PROMPTS[1], params, use_tqdm=False)
    fine = SamplingParams(temperature=0, min_tokens=2, max_tokens=4, allowed_token_ids=[eos, 11])
    assert llm.generate(PROMPTS[1], fine, use_tqdm=False)[0].outputs[0].token_ids[:2] == [11, 11]
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_waiting"] == 0


def test_greedy_bad_words_match_hf_bad_words_ids(llm, hf_model, hf_greedy, prompt_ids):
    picks = [1, 4]
    # The first greedy word of prompt 1, and a two-token run from the middle of prompt 4's greedy output.
    run = hf_greedy[4][0][3:5]
    words = [llm.tokenizer.decode(hf_greedy[1][0][:1]), llm.tokenizer.decode(run)]
    ids = bad_words_token_ids(llm.tokenizer, words)
    assert any(len(w) > 1 for w in ids)
    # HF also matches a word's prefix against the prompt; vLLM's rule (and kvpage's) only the output.
    assert not any(len(w) > 1 and prompt_ids[i][-1] == w[0] for w in ids for i in picks)
    params = SamplingParams(temperature=0, max_tokens=12, bad_words=words)
    outs = llm.generate([prompt_ids[i] for i in picks], params, use_tqdm=False)
    refs = hf_generate(hf_model, [prompt_ids[i] for i in picks], 12, processed=True,
                       bad_words_ids=[list(w) for w in ids])
    assert_greedy_matches(outs, refs)
    assert all(o.outputs[0].token_ids != hf_greedy[i][0][:12] for o, i in zip(outs, picks))


def test_bad_words_ban_a_words_last_token_only_after_its_other_tokens():
    logits = torch.zeros(50)
    apply_bad_words(logits, ((7,), (3, 9), (4, 5, 6)), [1, 2, 3])
    assert logits.isinf().nonzero().flatten().tolist() == [7, 9]  # (4, 5, 6): the output does not end in 4, 5
    logits = torch.zeros(50)
    apply_bad_words(logits, ((4, 5, 6), (60,)), [4, 5])  # 60: past the vocabulary, nothing to ban
    assert logits.isinf().nonzero().flatten().tolist() == [6]
    logits = torch.zeros(50)
    apply_bad_words(logits, ((3, 9),), [])  # nothing generated yet: the prompt does not count
    assert not logits.isinf().any()
