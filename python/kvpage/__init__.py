"""kvpage: a paged KV-cache LLM inference engine (CUDA + vectorised CPU kernels, vLLM-style scheduling)."""
import importlib
import os

# libgomp spins 300,000 PAUSEs at every OpenMP barrier unless a process runs more OpenMP threads than CPUs
# (then 1,000): on a shared or oversubscribed machine a team thread that loses its core leaves its partner
# spinning for tens of milliseconds per barrier and steps crawl. 30,000 (about a millisecond, as
# vLLM's KMP_BLOCKTIME=1 for Intel's runtime) kept a quiet machine's speed, where 1,000 cost a few percent, and was
# as fast as 1,000 beside CPU burners. It takes effect where kvpage is imported before torch loads libgomp, and in
# every process kvpage starts; the user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
GOMP_SPINCOUNT_DEFAULT = "30000"
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT

from . import hf_registry

__version__ = "0.1.0"

# attn_implementation="kvpage" works in transformers from here on, without importing it now.
hf_registry.install()

# Submodules load on first use, so the pure-Python bookkeeping (kvpage.core) imports
# without the compiled extension, and `import kvpage` stays cheap.
_LAZY_SUBMODULES = ("ops", "core", "engine", "model", "costmodel")
# The public engine API, importable as kvpage.LLM etc.; torch and transformers load on first access.
_ENGINE_EXPORTS = ("LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob")
# transformers' Cache on kvpage blocks, for HF `model.generate(cache=kvpage.PagedCache(...))`.
_HF_EXPORTS = ("PagedCache", "PagedCacheStats")
__all__ = list(_ENGINE_EXPORTS) + list(_HF_EXPORTS) + list(_LAZY_SUBMODULES)


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"kvpage.{name}")
    if name in _ENGINE_EXPORTS:
        return getattr(importlib.import_module("kvpage.engine"), name)
    if name in _HF_EXPORTS:
        return getattr(importlib.import_module("kvpage.integrations"), name)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
