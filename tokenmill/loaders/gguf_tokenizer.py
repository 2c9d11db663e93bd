"""The tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

A GGUF has no tokenizer.json: it holds the token list, token types, scores (SentencePiece) or
merges (byte-level BPE), special token ids and flags under llama.cpp's key names.
"""

from __future__ import annotations

from tokenmill.loaders.gguf_file import GGUFFile, field_value, open_gguf
from tokenmill.loaders.vocab import Vocab, build_tokenizer
from tokenmill.tokenizer import Tokenizer

# End-of-turn style ids that stop generation besides eos (e.g. Llama 3's <|eot_id|>).
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# Control tokens that end a turn though no key names them (Gemma's <end_of_turn>): llama.cpp
# recognizes the same texts (llama-vocab.cpp, its end-of-generation set).
_END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<|eom_id|>", "<EOT>", "<|end_of_text|>")
_CONTROL = 3  # llama.cpp's token type of control tokens


def read_gguf_vocab(reader: GGUFFile) -> Vocab | None:
    """The vocabulary described by the metadata; None when the file has no tokenizer."""
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        return None
    kind = field_value(reader, "tokenizer.ggml.model", "llama")
    merges = field_value(reader, "tokenizer.ggml.merges")
    return Vocab(
        kind=kind,
        tokens=tokens,
        types=field_value(reader, "tokenizer.ggml.token_type"),
        scores=field_value(reader, "tokenizer.ggml.scores"),
        merges=[_split_merge(m) for m in merges] if merges is not None else None,
        pre=field_value(reader, "tokenizer.ggml.pre", "default"),
        bos_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        unk_id=field_value(reader, "tokenizer.ggml.unknown_token_id"),
        # llama.cpp's defaults: SentencePiece vocabularies add BOS and a dummy prefix space.
        add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        add_space_prefix=bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True)),
        chat_template=field_value(reader, "tokenizer.chat_template"),
        extra_eos_ids=_end_of_turn_ids(reader, tokens),
    )


def _end_of_turn_ids(reader: GGUFFile, tokens: list[str]) -> list[int]:
    ids = [i for i in (field_value(reader, k) for k in _EXTRA_EOS_KEYS) if i is not None]
    types = field_value(reader, "tokenizer.ggml.token_type") or []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == _CONTROL and text in _END_OF_TURN_TEXTS and i not in ids:
            ids.append(i)
    return ids


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"malformed GGUF merge {merge!r} (expected 'left right')")
    return left, right


def load_gguf_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a .gguf file (model or vocabulary-only); None when it has none."""
    vocab = read_gguf_vocab(open_gguf(path))
    if vocab is None:
        return None
    try:
        return build_tokenizer(vocab)
    except ValueError as e:
        raise ValueError(f"cannot build the tokenizer of {path!r}: {e}") from e
