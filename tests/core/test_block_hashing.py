import hashlib
import os
import struct
import subprocess
import sys

import pytest

from kvpage.core import ROOT_HASH, hash_block_tokens

PYTHON_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "python")


def _hash_in_subprocess(hash_seed: str) -> str:
    code = "from kvpage.core import ROOT_HASH, hash_block_tokens as h; print(h(ROOT_HASH, list(range(16)), ('lora', 3)).hex())"
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=PYTHON_DIR)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_hash_is_blake2b_over_parent_and_packed_tokens():
    tokens = [5, 0, 2**40, 7]
    expected = hashlib.blake2b(ROOT_HASH + struct.pack("<4q", *tokens), digest_size=16).digest()
    assert hash_block_tokens(ROOT_HASH, tokens) == expected


def test_hash_is_stable_across_processes_with_different_hash_seeds():
    here = hash_block_tokens(ROOT_HASH, list(range(16)), ("lora", 3)).hex()
    assert _hash_in_subprocess("1") == _hash_in_subprocess("2") == here


def test_hash_commits_to_parent_tokens_and_extra_keys():
    block = [1, 2, 3, 4]
    first = hash_block_tokens(ROOT_HASH, block)
    assert hash_block_tokens(first, block) != first  # same tokens, different prefix
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 5]) != first
    assert hash_block_tokens(ROOT_HASH, block, ("salt",)) != first
    assert hash_block_tokens(ROOT_HASH, block, ("salt",)) == hash_block_tokens(ROOT_HASH, block, ("salt",))


def test_token_ids_outside_int64_are_rejected():
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(ROOT_HASH, [2**63])
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(ROOT_HASH, [1.5])


def test_core_imports_without_torch_or_the_extension():
    code = "import sys, kvpage.core; assert 'torch' not in sys.modules and 'kvpage._C' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
