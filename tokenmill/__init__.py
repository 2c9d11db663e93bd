"""tokenmill: a small, readable LLM inference engine (paged KV cache, prefix caching,
continuous batching) with vLLM's Python API."""

from tokenmill.config import EngineConfig
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
]
__version__ = "0.1.0"
