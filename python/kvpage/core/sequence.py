"""Per-sequence state the scheduler owns and the block manager reads and updates."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Union

_EXTRA_KEY_TYPES = (int, str, bytes, bool, type(None))


def _check_extra_keys(extra_keys) -> tuple:
    if not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys must be a tuple, got {type(extra_keys).__name__}")
    for key in extra_keys:
        if isinstance(key, tuple):
            _check_extra_keys(key)
        elif not isinstance(key, _EXTRA_KEY_TYPES):
            # repr() of these is the same in every process; of arbitrary objects it need not be.
            raise TypeError(f"extra_keys may hold int, str, bytes, bool, None or tuples, got {type(key).__name__}")
    return extra_keys


# slots: the per-token path reads these attributes several times per token.
@dataclass(eq=False, slots=True)
class Sequence:
    """One stream of tokens with its KV cache.

    token_ids is append-only (prefix hashes of full blocks are memoised in block_hashes).
    num_computed_tokens counts the leading tokens whose K/V sit in the cache. block_tables (one per
    KV-cache group, in layout order, all the same length) and swapped belong to the BlockManager:
    swapped means the tables index the host pool. block_table is group 0's.
    """

    seq_id: int
    token_ids: list[int]
    extra_keys: tuple = ()
    num_prompt_tokens: int = -1
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0
    swapped: bool = False
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # [spec decode] this step's proposed tokens (kvpage.spec_decode): computed as extra query tokens in
    # lookahead slots, never part of token_ids nor of any block hash; cleared once the step is verified.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, list):
            self.token_ids = list(self.token_ids)
        if not self.token_ids:
            raise ValueError("token_ids must not be empty")
        _check_extra_keys(self.extra_keys)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, seq_id: int) -> "Sequence":
        """A child with the same tokens and no blocks yet; BlockManager.fork shares the blocks."""
        return Sequence(seq_id, list(self.token_ids), self.extra_keys, self.num_prompt_tokens)


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request (n > 1 samples, beam candidates); they may share blocks."""

    request_id: str
    seqs: list[Sequence]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


SequenceLike = Union[Sequence, SequenceGroup, Iterable[Sequence]]


def as_seqs(seqs: SequenceLike) -> list[Sequence]:
    if isinstance(seqs, Sequence):
        return [seqs]
    result = list(seqs)
    for seq in result:
        if not isinstance(seq, Sequence):
            raise TypeError(f"seqs must hold Sequence objects, got {type(seq).__name__}")
    return result
