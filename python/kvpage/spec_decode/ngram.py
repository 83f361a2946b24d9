"""Prompt-lookup (n-gram) proposals: vLLM's "ngram" method.

The sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up earlier in
its own tokens (prompt and output); the k tokens that followed the match are the proposal. Copy-heavy work
(rewriting, summarizing or editing a given text) repeats long runs of its prompt, which this finds for free.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of the longest matching suffix n-gram."""
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return []
        a = np.asarray(token_ids, dtype=np.int64)
        # Candidates: earlier positions j holding the last token (a match must leave a token after it).
        ends = np.flatnonzero(a[:length - 1] == a[-1])
        best_len = 1
        m = 1
        while ends.size and m < self.max_n:
            # Keep the ends whose match extends one more token back.
            ok = ends >= m
            ends_m = ends[ok]
            ends_m = ends_m[a[ends_m - m] == a[length - 1 - m]]
            if not ends_m.size:
                break
            ends, m = ends_m, m + 1
            best_len = m
        if not ends.size or best_len < self.min_n:
            return []
        j = int(ends[-1])  # the latest among the longest matches
        return a[j + 1:j + 1 + k].tolist()
