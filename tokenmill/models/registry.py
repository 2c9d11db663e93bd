"""Which family module implements a Hugging Face `architectures` string or a GGUF
`general.architecture`. A family module (tokenmill/models/<family>.py) holds the family's
facts: MODELS (HF class name -> model class), config_from_hf(arch, config.json dict) and, if
it loads from GGUF, GGUF (GGUF architecture -> loaders.gguf_family.GGUFFamily)."""

from __future__ import annotations

import importlib
from types import ModuleType

from torch import nn

_LLAMA, _GPT2 = "tokenmill.models.llama", "tokenmill.models.gpt2"
_GEMMA3 = "tokenmill.models.gemma3"

_FAMILY_OF_ARCHITECTURE = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "GPT2LMHeadModel": _GPT2,
    "Phi3ForCausalLM": "tokenmill.models.phi3",
    "Gemma3ForCausalLM": _GEMMA3,
    "DeepseekV2ForCausalLM": "tokenmill.models.deepseek",
    "DeepseekV3ForCausalLM": "tokenmill.models.deepseek",
    "DeepseekV4ForCausalLM": "tokenmill.models.deepseek_v4",
}
_FAMILY_OF_GGUF_ARCHITECTURE = {"llama": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
                               "phi3": "tokenmill.models.phi3",
                               "gemma3": _GEMMA3}

SUPPORTED_ARCHITECTURES = tuple(_FAMILY_OF_ARCHITECTURE)
SUPPORTED_GGUF_ARCHITECTURES = tuple(_FAMILY_OF_GGUF_ARCHITECTURE)

# A config.json without `architectures` (as written from a GGUF by transformers) names only
# its model_type; transformers' AutoModelForCausalLM maps these the same way.
_CAUSAL_LM_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
}


def architecture_of(cfg: dict) -> str:
    """The architecture a Hugging Face config.json names (or implies by its model_type)."""
    if cfg.get("architectures"):
        return cfg["architectures"][0]
    model_type = cfg.get("model_type", "?")
    return _CAUSAL_LM_OF_MODEL_TYPE.get(model_type, model_type)


def family(architecture: str) -> ModuleType:
    """The family module of a Hugging Face architecture; a clear error for any other."""
    if architecture not in _FAMILY_OF_ARCHITECTURE:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return importlib.import_module(_FAMILY_OF_ARCHITECTURE[architecture])


def model_class(architecture: str) -> type[nn.Module]:
    return family(architecture).MODELS[architecture]


def gguf_family(gguf_architecture: str):
    """The GGUFFamily of a GGUF architecture name; a clear error for any other."""
    if gguf_architecture not in _FAMILY_OF_GGUF_ARCHITECTURE:
        raise ValueError(f"GGUF architecture {gguf_architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    module = importlib.import_module(_FAMILY_OF_GGUF_ARCHITECTURE[gguf_architecture])
    return module.GGUF[gguf_architecture]
