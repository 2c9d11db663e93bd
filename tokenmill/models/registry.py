"""Maps a Hugging Face `architectures` string to the model class that implements it."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("tokenmill.models.gpt2", "GPT2LMHeadModel"),
}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
