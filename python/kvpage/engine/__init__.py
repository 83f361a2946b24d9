"""The user-facing engine: LLM, LLMEngine, SamplingParams and the outputs (vLLM's names).

The names load on first access (PEP 562), so that SamplingParams, pure Python, imports without torch:
the `kvpage` command checks its flags with it before anything heavy loads."""
import importlib

_EXPORTS = {"CompletionOutput": "outputs", "EngineConfig": "llm_engine", "LLM": "llm", "LLMEngine": "llm_engine",
            "Logprob": "outputs", "RequestOutput": "outputs", "SampleRow": "sampler", "Sampler": "sampler",
            "SamplingParams": "sampling_params"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
