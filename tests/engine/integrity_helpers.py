"""A small engine and a fault injector for the integrity tests and bench/engine_faults.py.

The injector raises an exception at the k-th line kvpage's bookkeeping executes (the scheduler, the
block manager and pools, the engine, beam search, the runner's Python), as an interrupt or a bug
would. It skips sections that run with Ctrl-C deferred (kvpage.core.interrupts), since no real
interrupt can land there.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import kvpage
from kvpage import SamplingParams
from kvpage.core import check_block_manager
from kvpage.core.interrupts import deferring
from kvpage.model.loader import default_model_dir

_PACKAGE = Path(kvpage.__file__).resolve().parent
TRACED = tuple(str(_PACKAGE / d) for d in ("core", "engine", "model/runner.py"))

PROMPTS = ["The capital of France is", "Hello, my name is", "Water is made of", "def add(a, b):",
           "The capital of France is a city where", "1, 2, 3, 4,"]


def tiny_llm(**kwargs) -> kvpage.LLM:
    """A random 2-layer Llama with the default model's tokenizer (real text, stop strings, bad words)."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         eos_token_id=tokenizer.eos_token_id, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    kwargs.setdefault("num_kv_blocks", 40)
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("swap_space_gib", 0.001)
    return kvpage.LLM(model=model, tokenizer=tokenizer, **kwargs)


def workload(seed: int = 0) -> tuple[list[str], list[SamplingParams]]:
    """Shared prefixes (prefix hits), n=2 (forks, copy-on-write), stop strings, bad words, prompt
    logprobs, a seeded sample and a beam search: every path the bookkeeping has."""
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, seed=seed, n=2, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=12, stop=["e"], bad_words=["the"]),
              SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(beam_width=2, max_tokens=6)]
    return PROMPTS, params


CONTROL = SamplingParams(temperature=0, max_tokens=16)


def control_tokens(llm: kvpage.LLM) -> list[int]:
    return llm.generate([PROMPTS[0]], CONTROL, use_tqdm=False)[0].outputs[0].token_ids


class Injected(Exception):
    """Stands for a bug: an ordinary exception raised somewhere inside the engine."""


class Injector:
    """sys.settrace hook raising `exc` at the `target`-th traced line (1-based); counts lines when
    target is 0. Tracing stops once it fires (CPython unsets a trace function that raised)."""

    def __init__(self, target: int = 0, exc: type[BaseException] = KeyboardInterrupt) -> None:
        self.target, self.exc, self.count, self.fired = target, exc, 0, False

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(TRACED) else None

    def _local(self, frame, event, arg):
        if event == "line" and not deferring():
            self.count += 1
            if self.count == self.target:
                self.fired = True
                raise self.exc(f"injected at {frame.f_code.co_filename}:{frame.f_lineno}")
        return self._local

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


def run_with_fault(llm: kvpage.LLM, target: int, exc: type[BaseException], seed: int = 0):
    """generate() the workload with a fault at line `target`; the outputs, or None if it fired."""
    prompts, params = workload(seed)
    try:
        with Injector(target, exc):
            return llm.generate(prompts, params, use_tqdm=False)
    except (KeyboardInterrupt, Injected):
        return None


def count_lines(llm: kvpage.LLM) -> int:
    prompts, params = workload()
    with Injector() as counter:
        llm.generate(prompts, params, use_tqdm=False)
    return counter.count


def assert_whole_and_idle(llm: kvpage.LLM) -> None:
    """The bookkeeping invariants hold, and nothing is running, queued or holding a block."""
    engine = llm.llm_engine
    scheduler = engine.scheduler
    stats = llm.stats()  # first: like every call, it finishes a clean-up an interrupt cut short
    check_block_manager(engine.block_manager, scheduler.sequences())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0, stats
    assert stats["num_swapped"] == 0 and engine.block_manager.host.num_used == 0, stats
    assert not engine.has_unfinished_requests() and scheduler.pending is None
