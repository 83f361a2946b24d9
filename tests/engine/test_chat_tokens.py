"""A chat prompt's token ids piece by piece between the tokenizer's added tokens (kvpage.engine.chat_tokens): the
same ids as encoding the chat template's text whole, for the default model's tokenizer on many conversations, and
for tokenizers built here; tokenizers whose pieces are not independent get no piecewise encoder."""
from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine_helpers import GREEDY
from kvpage.engine import chat_tokens
from kvpage.engine.chat_tokens import SegmentEncoder, encode_chat_text
from kvpage.engine.prompt_inputs import chat_template_prompt
from kvpage.model.loader import default_model_dir

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PIECES = ["Hello", " world", "  two  spaces ", "\n", "\n\n", "\t tab", "ünïcödé", "日本語のテキスト", "emoji \U0001f600",
          "x", " ", "", "numbers 12345 and 3.14", "<|im_end|>", "<|im_start|>user\n", "trailing   ", "'s 've n't",
          "def f(x):\n    return x + 1\n", "a" * 40, " the river garden engine cache memory block token"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


def _text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(pieces))


def _conversation(rng: random.Random, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": _text(rng, 3)}] if rng.random() < 0.5 else []
    for t in range(turns):
        messages.append({"role": "user", "content": _text(rng, rng.randrange(1, 12))})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": _text(rng, rng.randrange(0, 6))})
    return messages


def test_default_tokenizer_chat_ids_equal_whole_text_encoding(tokenizer):
    assert SegmentEncoder.of(tokenizer) is not None  # SmolLM2's pieces are independent: the piecewise path runs
    rng = random.Random(0)
    conversations = [_conversation(rng, rng.randrange(1, 8)) for _ in range(60)]
    for _ in range(2):  # cold, then with every earlier message's pieces cached
        for messages in conversations:
            text, ids = chat_template_prompt(tokenizer, messages)
            assert ids == tokenizer.encode(text, add_special_tokens=False), text
            # A conversation grown by a turn (how a chat re-sends its history) reuses the cached pieces.
            grown = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(rng, 4)}]
            text, ids = chat_template_prompt(tokenizer, grown)
            assert ids == tokenizer.encode(text, add_special_tokens=False), text


def test_chat_greedy_outputs_equal_whole_text_ids(llm):
    rng = random.Random(1)
    conversations = [_conversation(rng, 3) for _ in range(3)]
    got = llm.chat(conversations, GREEDY, use_tqdm=False)
    texts = [llm.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    want = llm.generate([{"prompt_token_ids": llm.tokenizer.encode(t, add_special_tokens=False)} for t in texts],
                        GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def _trained(pre_tokenizer, decoder, normalizer=None, specials=SPECIALS) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    corpus = [" ".join(PIECES) * 3, "the quick brown fox jumps over the lazy dog " * 20]
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=alphabet, show_progress=False))
    return tok


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_level_bpe_pieces_equal_whole_text():
    fast = _fast(_trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()))
    encoder = SegmentEncoder.of(fast)
    assert encoder is not None
    rng = random.Random(2)
    for _ in range(200):
        text = _text(rng, rng.randrange(1, 15))
        assert encoder.encode(text) == fast.encode(text, add_special_tokens=False), text
    assert encoder.hits > 0


def _naive_pieces_differ(fast: PreTrainedTokenizerFast, added: list[str], texts: list[str]) -> bool:
    """Whether encoding between the added tokens, piece by piece, gives other ids than the whole text for a
    text: the guard below is what keeps such a tokenizer off the piecewise path."""
    encoder = SegmentEncoder(fast, {t: fast.convert_tokens_to_ids(t) for t in added})
    return any(encoder.encode(t) != fast.encode(t, add_special_tokens=False) for t in texts)


def test_metaspace_first_only_prefix_gets_no_piecewise_encoder():
    # SentencePiece-style: the prefix space goes on the input's first piece only, so a piece after an added
    # token encodes differently alone than in its text.
    fast = _fast(_trained(pre_tokenizers.Metaspace(prepend_scheme="first"), decoders.Metaspace(prepend_scheme="first")))
    assert _naive_pieces_differ(fast, SPECIALS, ["<|im_start|>user hello world<|im_end|> the fox"])
    assert SegmentEncoder.of(fast) is None
    text = "<|im_start|>user hello world<|im_end|> the fox"
    assert encode_chat_text(fast, text) == fast.encode(text, add_special_tokens=False)
    always = _fast(_trained(pre_tokenizers.Metaspace(prepend_scheme="always"), decoders.Metaspace()))
    assert SegmentEncoder.of(always) is not None  # every piece gets its prefix alike: independent


def test_added_tokens_that_take_surrounding_text_get_no_piecewise_encoder():
    from tokenizers import AddedToken

    for flags in ({"lstrip": True}, {"rstrip": True}, {"single_word": True}):
        tok = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
        tok.add_special_tokens([AddedToken("<|tool|>", special=True, normalized=False, **flags)])
        fast = _fast(tok)
        assert SegmentEncoder.of(fast) is None, flags
        text = "call  <|tool|>  now<|im_end|>"
        assert encode_chat_text(fast, text) == fast.encode(text, add_special_tokens=False)
    # matched on normalized text where a normalizer exists (a lowercasing one here)
    tok = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), normalizers.Lowercase())
    tok.add_tokens([AddedToken("Fox", normalized=True)])
    assert SegmentEncoder.of(_fast(tok)) is None


@pytest.mark.parametrize("max_chars, max_pieces", [(400, 16_384), (4_000_000, 5)])
def test_cache_stays_within_its_bounds_and_answers_stay_exact(tokenizer, monkeypatch, max_chars, max_pieces):
    monkeypatch.setattr(chat_tokens, "MAX_CACHED_PIECES", max_pieces)
    encoder = SegmentEncoder(tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS},
                             max_cached_chars=max_chars)
    rng = random.Random(3)
    for _ in range(100):
        text = "<|im_start|>".join(_text(rng, 4) for _ in range(4))
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
        assert encoder._cached_chars <= max_chars and len(encoder._cache) <= max_pieces
    assert encoder.misses > 0 and encoder.hits > 0


def test_encoder_does_not_keep_its_tokenizer_alive():
    fast = _fast(_trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()))
    assert encode_chat_text(fast, "<|im_start|>user hi<|im_end|>") == fast.encode("<|im_start|>user hi<|im_end|>",
                                                                              add_special_tokens=False)
    gone = weakref.ref(fast)
    del fast
    gc.collect()
    assert gone() is None


def test_threads_share_one_encoder(tokenizer):
    rng = random.Random(4)
    texts = [tokenizer.apply_chat_template(_conversation(rng, 4), tokenize=False, add_generation_prompt=True)
             for _ in range(16)]
    want = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    failures = []

    def run(k: int) -> None:
        for i in range(40):
            j = (i * 7 + k) % len(texts)
            if encode_chat_text(tokenizer, texts[j]) != want[j]:
                failures.append(j)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
