"""A chat prompt's token ids, message by message: every turn of a conversation re-sends its whole history, and
tokenizing that history again is a cost of each request that grows with the conversation and comes before the
prefix cache can take over (it is on the way to the first token).

A fast (HF tokenizers) tokenizer splits its input at its added tokens (<|im_start|>, <|im_end|>, ...) before
anything else, then normalizes, pre-tokenizes and encodes each piece between them on its own. The ids of
encode(text, add_special_tokens=False) are then the concatenation of each piece's ids, and a piece seen before
(an earlier message, as the chat template wrote it) is taken from a cache instead of encoded again. That holds
only for tokenizers whose pieces really are independent; SegmentEncoder.of returns None for any other (then
the whole text is encoded as before):
  - an added token with lstrip / rstrip / single_word (its match takes or depends on the text around it), or
    normalized (matched on normalized text, where a normalizer exists);
  - a Metaspace pre-tokenizer that prepends its space to the first piece only (prepend_scheme "first");
  - special tokens encoded as text (split_special_tokens), truncation or padding configured in the backend;
  - a tokenizer whose pieces disagree with its whole-text encoding on a probe text.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict

# The cache's bounds: characters of the pieces it keeps (their ids take about a quarter as many entries), and
# pieces (each entry's own overhead, for many short ones).
MAX_CACHED_CHARS = 4_000_000
MAX_CACHED_PIECES = 16_384

_PROBE = ("Hello<|sep|> world  \n\n<|sep|>\tFirst line.\n  second line <|sep|><|sep|>x y z.<|sep|> ünïcödé "
          "日本語 emoji \U0001f600 <|sep|>   ")


class SegmentEncoder:
    """encode(text) == tokenizer.encode(text, add_special_tokens=False), piece by piece between the tokenizer's
    added tokens, with each piece's ids cached (LRU, bounded by MAX_CACHED_CHARS and MAX_CACHED_PIECES). Thread-safe: the server's tokenizer
    pool calls it from several threads."""

    def __init__(self, tokenizer, added: dict[str, int], max_cached_chars: int = MAX_CACHED_CHARS) -> None:
        # Weakly: encode_chat_text keeps encoders in a WeakKeyDictionary by tokenizer, which a strong reference
        # from its value would keep alive for ever.
        self._tokenizer = weakref.ref(tokenizer)
        self.added = added  # content -> id of every added token
        # Longest first: at one position the longest added token wins, as the tokenizer's own matching does.
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self.max_cached_chars = max_cached_chars
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def of(cls, tokenizer) -> "SegmentEncoder | None":
        """The tokenizer's encoder, or None where its pieces are not encoded independently (module docstring)."""
        added = _independent_added_tokens(tokenizer)
        if not added:
            return None
        encoder = cls(tokenizer, added)
        seps = iter(sorted(added)[:4] * _PROBE.count("<|sep|>"))  # several of its added tokens, in turn
        probe = re.sub(re.escape("<|sep|>"), lambda _: next(seps), _PROBE)
        if encoder.encode(probe) != list(tokenizer.encode(probe, add_special_tokens=False)):
            return None
        encoder._cache.clear()
        encoder._cached_chars = encoder.hits = encoder.misses = 0
        return encoder

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pieces = self._split.split(text)
        for i, piece in enumerate(pieces):
            if i % 2:  # re.split's captured separators: the added tokens
                ids.append(self.added[piece])
            elif piece:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> tuple[int, ...] | list[int]:
        tokenizer = self._tokenizer()
        if len(piece) > self.max_cached_chars // 4:  # one huge prompt would empty the cache
            return tokenizer.encode(piece, add_special_tokens=False)
        with self._lock:
            ids = self._cache.get(piece)
            if ids is not None:
                self._cache.move_to_end(piece)
                self.hits += 1
                return ids
        ids = tuple(tokenizer.encode(piece, add_special_tokens=False))
        with self._lock:
            self.misses += 1
            if piece not in self._cache:
                self._cache[piece] = ids
                self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars or len(self._cache) > MAX_CACHED_PIECES:
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids


def _independent_added_tokens(tokenizer) -> dict[str, int] | None:
    """content -> id of the tokenizer's added tokens where each piece between them is encoded on its own; None
    where that does not hold, or where the tokenizer is not a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if backend is None or not decoder or getattr(tokenizer, "split_special_tokens", False):
        return None
    if getattr(backend, "encode_special_tokens", False) or backend.truncation is not None or backend.padding is not None:
        return None
    try:  # each component's own JSON (the whole tokenizer's, vocabulary and merges, takes ~0.2 s to write)
        pre_tokenizer, normalizer = (None if c is None else json.loads(c.__getstate__())
                                     for c in (backend.pre_tokenizer, backend.normalizer))
    except Exception:  # a backend that cannot describe itself: assume nothing
        return None
    if _has_first_only_prefix(pre_tokenizer) or _has_first_only_prefix(normalizer):
        return None
    has_normalizer = normalizer is not None
    added = {}
    for token_id, token in decoder.items():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized and has_normalizer) or not token.content:
            return None
        added[token.content] = token_id
    return added


def _has_first_only_prefix(component) -> bool:
    """A Metaspace anywhere in a pre-tokenizer (or normalizer) config that treats the input's first piece apart."""
    if isinstance(component, dict):
        if component.get("type") == "Metaspace" and component.get("prepend_scheme", "always") == "first":
            return True
        return any(_has_first_only_prefix(v) for v in component.values())
    if isinstance(component, list):
        return any(_has_first_only_prefix(v) for v in component)
    return False


_ENCODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()
_NONE = object()


def encode_chat_text(tokenizer, text: str) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=False) of a chat template's output, through the tokenizer's
    SegmentEncoder where it has one."""
    try:
        with _ENCODERS_LOCK:
            encoder = _ENCODERS.get(tokenizer)
            if encoder is None:
                encoder = _ENCODERS[tokenizer] = SegmentEncoder.of(tokenizer) or _NONE
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: encoded whole
        encoder = _NONE
    if encoder is _NONE:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return encoder.encode(text)
