"""tokenmill: a small, readable LLM inference engine (paged KV cache, prefix caching,
continuous batching) with vLLM's Python API.

Names are imported on first use, so `tokenmill --help` does not wait for torch to load."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "tokenmill.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.structured_outputs",
    "EngineConfig": "tokenmill.config",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "RequestMetrics": "tokenmill.outputs",
    "Logprob": "tokenmill.outputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
