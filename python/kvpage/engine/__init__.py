"""The user-facing engine: LLM, LLMEngine, SamplingParams and the outputs (vLLM's names)."""
from .llm import LLM
from .llm_engine import EngineConfig, LLMEngine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampler import Sampler, SampleRow
from .sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "Logprob", "RequestOutput", "SampleRow",
           "Sampler", "SamplingParams"]
