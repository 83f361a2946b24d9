"""Small drivers that play the scheduler's part in one step, shared by the block-manager tests."""
import pytest

from kvpage.core import BlockManager, Sequence


def _prefill(bm: BlockManager, seq_id: int, tokens: list, extra_keys: tuple = ()) -> Sequence:
    """Admit a sequence and compute its whole prompt (past any prefix-cache hit)."""
    seq = Sequence(seq_id, list(tokens), extra_keys=extra_keys)
    bm.allocate(seq)
    bm.mark_computed(seq, len(seq.token_ids) - seq.num_computed_tokens)
    return seq


def _decode(bm: BlockManager, seq: Sequence, token: int) -> list:
    """One decode step: the sampled token is appended, gets a slot, and is computed."""
    seq.append_token(token)
    copies = bm.append_slots(seq, 1)
    bm.mark_computed(seq, 1)
    return copies


def _fork(bm: BlockManager, parent: Sequence, seq_id: int) -> Sequence:
    child = parent.fork(seq_id)
    bm.fork(parent, child)
    return child


@pytest.fixture
def prefill():
    return _prefill


@pytest.fixture
def decode():
    return _decode


@pytest.fixture
def fork():
    return _fork
