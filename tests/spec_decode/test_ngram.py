"""The n-gram (prompt lookup) proposer, against a brute-force reference."""
from __future__ import annotations

import random

import pytest

from kvpage.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix n-gram (lo <= n <= hi) followed by a token."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_examples():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert p.propose([1, 2, 3, 9, 2, 3, 7, 2, 3], 2) == [7, 2]  # longest match (2 tokens), the latest one
    assert p.propose([5, 6], 2) == []
    assert p.propose([1, 2, 3], 2) == []  # no earlier occurrence
    assert NgramProposer(2, 3).propose([1, 2, 3, 9, 4, 3], 2) == []  # only a 1-token match: below min


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_matches_reference(lo, hi):
    rng = random.Random(lo * 10 + hi)
    p = NgramProposer(lo, hi)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        assert p.propose(tokens, k) == reference(tokens, k, lo, hi), tokens
