"""Incremental detokenization and stop strings, for streaming and for requests with `stop`.

Decoding a window of recent tokens rather than the whole output keeps each step O(1) per sequence;
the window starts a few tokens back (prefix_offset) so that tokenizers which treat a leading token
specially (SentencePiece's dropped space) and multi-token UTF-8 characters come out right, as in
vLLM's detokenize_incrementally. Requests that neither stream nor stop on strings skip all this and
are decoded once when they finish.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IncrementalDetokenizer:
    prompt_len: int
    skip_special_tokens: bool = True
    text: str = ""
    prefix_offset: int = 0  # into the output tokens: where the decode window starts
    read_offset: int = 0  # output tokens already turned into text
    stopped: bool = False  # the text was cut at a stop string: nothing more joins it

    def update(self, tokenizer, token_ids: list[int]) -> str:
        """Append the text of the output tokens added since the last call; returns the new text."""
        out = token_ids[self.prompt_len:]
        if len(out) <= self.read_offset:
            return ""
        prefix, full = self._window(tokenizer, out)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for its next byte-token
        return self._append(full[len(prefix):], len(out))

    def flush(self, tokenizer, token_ids: list[int]) -> None:
        """At the sequence's end: the text of tokens still held back (an incomplete UTF-8 character
        comes out as U+FFFD, as tokenizer.decode gives it), so that the text is the decode of every
        output token, whether or not the request streamed or had stop strings."""
        out = token_ids[self.prompt_len:]
        if self.stopped or len(out) <= self.read_offset:
            return
        prefix, full = self._window(tokenizer, out)
        self._append(full[len(prefix):], len(out))

    def _window(self, tokenizer, out: list[int]) -> tuple[str, str]:
        """The decode window's text up to the read tokens, and up to the last one."""
        skip = self.skip_special_tokens
        return (tokenizer.decode(out[self.prefix_offset:self.read_offset], skip_special_tokens=skip),
                tokenizer.decode(out[self.prefix_offset:], skip_special_tokens=skip))

    def _append(self, new: str, num_read: int) -> str:
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, num_read
        return new


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) in `text` of the earliest stop string, looking only where the last `new_len`
    characters could complete one (the first listed wins a tie); None if none."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(stop))
    return best
