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

# A config.json without `architectures` (as written from a GGUF by transformers) names only
# its model_type; transformers' AutoModelForCausalLM maps these the same way.
_CAUSAL_LM_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def architecture_of(cfg: dict) -> str:
    """The architecture a Hugging Face config.json names (or implies by its model_type)."""
    if cfg.get("architectures"):
        return cfg["architectures"][0]
    model_type = cfg.get("model_type", "?")
    return _CAUSAL_LM_OF_MODEL_TYPE.get(model_type, model_type)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
