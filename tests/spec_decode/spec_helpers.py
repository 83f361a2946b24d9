"""Prompts and checks shared by the speculative decoding tests."""
from __future__ import annotations

import kvpage
from kvpage import SamplingParams
from kvpage.core.invariants import check_block_manager

# Copy-friendly prompts (repeated text gives n-gram matches), and one with little repetition.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4,",
    "Water is made of hydrogen and oxygen.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(path: str, prompts, params, **options) -> tuple[list, kvpage.LLM]:
    options.setdefault("num_kv_blocks", 256)
    options.setdefault("block_size", 4)
    llm = kvpage.LLM(model=path, **options)
    return llm.generate(prompts, params, use_tqdm=False), llm


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def texts(outputs) -> list[list[str]]:
    return [[c.text for c in out.outputs] for out in outputs]


def assert_no_leaks(llm: kvpage.LLM) -> None:
    """Every request finished: no block held, the pools consistent with the (empty) set of sequences."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    check_block_manager(engine.block_manager, engine.scheduler.sequences())
    assert llm.stats()["kv_blocks_used"] == 0
