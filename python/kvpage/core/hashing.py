"""Content hashes for prefix caching: a chain over full blocks, stable across processes and machines."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The first block has no parent; a fixed all-zero digest keeps every chain link the same shape.
HASH_SIZE = 16
ROOT_HASH = bytes(HASH_SIZE)

_BLAKE2B = hashlib.blake2b(digest_size=HASH_SIZE)  # copying a prepared state beats constructing one
_packers: dict[int, struct.Struct] = {}
TOKEN_BYTES = 8  # one token's bytes in pack_tokens' output (little-endian int64)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, so bytes (and hashes) do not depend on the host."""
    n = len(token_ids)
    packer = _packers.get(n)
    if packer is None:
        packer = _packers[n] = struct.Struct(f"<{n}q")
    try:
        return packer.pack(*token_ids)
    except struct.error as e:
        raise ValueError(f"token_ids must be ints in int64 range: {e}") from None


def hash_block(parent_hash: bytes, token_bytes: bytes, extra_keys: tuple = ()) -> bytes:
    """Digest of one full block (tokens already packed), committing to all before it via `parent_hash`.

    `extra_keys` (e.g. a LoRA id or a cache salt) separate caches that must not share blocks even
    when their tokens agree; they are hashed through `repr`, which is stable for ints, strs, bytes
    and tuples of those, unlike Python's salted `hash()`.
    """
    h = _BLAKE2B.copy()
    h.update(parent_hash + token_bytes)
    if extra_keys:
        h.update(b"\x00extra:" + repr(extra_keys).encode())
    return h.digest()


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of KV-cache group `group` whose chain hash is `block_hash`:
    the hash itself for group 0 (a one-group cache keys exactly as before), tagged for the others."""
    return block_hash + group.to_bytes(2, "little") if group else block_hash


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    return hash_block(parent_hash, pack_tokens(token_ids), extra_keys)
