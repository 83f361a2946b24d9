"""kvpage: a paged KV-cache LLM inference engine (CUDA + vectorised CPU kernels, vLLM-style scheduling)."""
import importlib

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
