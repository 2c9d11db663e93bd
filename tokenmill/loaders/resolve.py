"""From what the user typed (a path or a model name) to files on disk, and the tokenizer."""

from __future__ import annotations

import os

from tokenmill.models.config import ModelConfig
from tokenmill.tokenizer import Tokenizer


def resolve_model(name_or_path: str) -> str:
    if os.path.exists(name_or_path):
        return name_or_path
    raise FileNotFoundError(
        f"model {name_or_path!r} not found: give a Hugging Face folder, a .gguf file or a "
        "llama2.c .bin file"
    )


def load_tokenizer(path: str, model_config: ModelConfig) -> Tokenizer | None:
    """The tokenizer that belongs to a model path (None when there is none)."""
    if os.path.isdir(path):
        tok = Tokenizer.from_folder(path)
        if tok is not None:  # generation_config.json may add more end-of-turn ids
            tok.eos_token_ids += [t for t in model_config.eos_token_ids
                                  if t not in tok.eos_token_ids]
        return tok
    if os.path.isfile(path) and path.endswith(".json"):
        return Tokenizer.from_folder(os.path.dirname(path))
    return None


def read_model_config(path: str) -> ModelConfig:
    """A model's hyperparameters without loading its weights."""
    from tokenmill.loaders import detect_format

    fmt = detect_format(path)
    if fmt == "hf":
        from tokenmill.loaders.hf import read_hf_config

        return read_hf_config(path)
    raise ValueError(f"cannot read the configuration of a {fmt} model without loading it")
