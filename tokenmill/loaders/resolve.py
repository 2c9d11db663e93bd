"""From what the user typed (a path or a model name) to files on disk, and the tokenizer."""

from __future__ import annotations

import os

from tokenmill.models.config import ModelConfig
from tokenmill.tokenizer import Tokenizer


def resolve_model(name_or_path: str) -> str:
    """An existing path as is; a known model name -> its cached file (pulled on first use)."""
    if os.path.exists(name_or_path):
        return name_or_path
    from tokenmill import hub

    if name_or_path in hub.KNOWN_MODELS:
        return hub.ensure(name_or_path)
    raise FileNotFoundError(
        f"model {name_or_path!r} not found: give a Hugging Face folder, a .gguf file, a "
        f"llama2.c .bin file, or a known model name ({', '.join(hub.KNOWN_MODELS)})"
    )


def load_tokenizer(path: str, model_config: ModelConfig | None = None) -> Tokenizer | None:
    """The tokenizer at path: a model folder, a tokenizer.json, a .gguf file (its metadata), a
    llama2.c tokenizer .bin, or for a llama2.c checkpoint the tokenizer file beside it. None
    when there is none. model_config adds the model's end-of-turn ids and a GGUF family's chat
    template; without it only the tokenizer's own files are read (tokenmill tokenize)."""
    if os.path.isdir(path):
        tok = Tokenizer.from_folder(path)
        if tok is not None and model_config:  # generation_config.json may add end-of-turn ids
            tok.eos_token_ids += [t for t in model_config.eos_token_ids
                                  if t not in tok.eos_token_ids]
        return tok
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {path!r} not found")
    if path.endswith(".json"):
        return Tokenizer.from_folder(os.path.dirname(path))
    if _is_gguf(path):
        from tokenmill.loaders.gguf_tokenizer import load_gguf_tokenizer

        tok = load_gguf_tokenizer(path)
        if tok is not None and not tok.chat_template and model_config:
            tok.chat_template = model_config.chat_template  # the family's own, as llama.cpp does
            tok.family_template = tok.chat_template is not None
        return tok
    from tokenmill.loaders.llama2c import is_llama2c_checkpoint
    from tokenmill.loaders.llama2c_tokenizer import load_llama2c_tokenizer

    if is_llama2c_checkpoint(path):
        vocab_size = (model_config or read_model_config(path)).vocab_size
        sibling = _llama2c_tokenizer_next_to(path, vocab_size)
        return load_llama2c_tokenizer(sibling) if sibling else None
    return load_llama2c_tokenizer(path)


def _llama2c_tokenizer_next_to(path: str, vocab_size: int) -> str | None:
    """llama2.c names a custom tokenizer tok{vocab_size}.bin and Llama 2's own (32000 tokens)
    tokenizer.bin; one of those next to the checkpoint is its tokenizer."""
    names = [f"tok{vocab_size}.bin"] + (["tokenizer.bin"] if vocab_size == 32000 else [])
    folder = os.path.dirname(os.path.abspath(path))
    return next((os.path.join(folder, n) for n in names
                 if os.path.isfile(os.path.join(folder, n))), None)


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_model_config(path: str) -> ModelConfig:
    """A model's hyperparameters without loading its weights."""
    from tokenmill.loaders import detect_format

    fmt = detect_format(path)
    if fmt == "hf":
        from tokenmill.loaders.hf import read_hf_config

        return read_hf_config(path)
    if fmt == "gguf":
        from tokenmill.loaders.gguf import gguf_config
        from tokenmill.loaders.gguf_file import open_gguf

        return gguf_config(open_gguf(path))
    from tokenmill.loaders.llama2c import llama2c_config, read_header

    return llama2c_config(read_header(path))
