"""Tokenizers rebuilt from a bare vocabulary (GGUF metadata, llama2.c tokenizer files).

Two families, both run by the Rust `tokenizers` backend:
- SentencePiece-style BPE ("llama"): pieces with scores, `▁` for spaces, a dummy prefix space,
  byte fallback to `<0xNN>` pieces. Merges are recovered from the scores (merges_cache.py).
- GPT-2-style byte-level BPE ("gpt2"): vocabulary plus merges, text split first by a regex that
  depends on the model family (llama.cpp's `tokenizer.ggml.pre`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from tokenmill.loaders.merges_cache import cached_merges
from tokenmill.tokenizer import Tokenizer

# llama.cpp token types (gguf.TokenType); a vocabulary without types has only NORMAL tokens.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # SentencePiece's visible space, `▁`

# Pre-tokenizer split regexes by llama.cpp pre-tokenizer name (from llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_STYLE = ("default", "gpt-2", "gpt2")
_DIGIT_SPLIT = ("smollm",)  # every digit on its own, then GPT-2's regex
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Llama 3's tokenizer takes a pre-token whole when it is in the vocabulary (HF `ignore_merges`).
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")
SUPPORTED_PRE = _GPT2_STYLE + _DIGIT_SPLIT + tuple(_SPLITS)


@dataclass
class Vocab:
    """Everything a tokenizer file says, normalized across formats."""

    kind: str  # "llama" (SentencePiece-style) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int] | None = None
    scores: list[float] | None = None
    merges: list[tuple[str, str]] | None = None
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None
    extra_eos_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        for name in ("types", "scores"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.tokens):
                raise ValueError(f"the vocabulary has {len(self.tokens)} tokens but "
                                 f"{len(values)} token {name}")

    def type_of(self, token_id: int) -> int:
        return self.types[token_id] if self.types else NORMAL

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def build_tokenizer(vocab: Vocab) -> Tokenizer:
    """A tokenmill Tokenizer for the vocabulary (the backend does all encoding in Rust)."""
    vocab.validate()
    if vocab.kind == "llama":
        backend = sentencepiece_backend(vocab)
    elif vocab.kind == "gpt2":
        backend = byte_level_backend(vocab)
    else:
        raise ValueError(f"tokenizer model {vocab.kind!r} is not supported (only llama, gpt2)")
    _add_special_tokens(backend, vocab)
    return Tokenizer(
        backend, bos_token=vocab.token(vocab.bos_id), eos_token=vocab.token(vocab.eos_id),
        add_bos_token=vocab.add_bos, chat_template=vocab.chat_template,
        eos_token_ids=[i for i in vocab.extra_eos_ids if vocab.token(i) is not None],
    )


def _token_ids(tokens: list[str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)  # a duplicated spelling keeps its first id
    return ids


def merges_from_scores(vocab: Vocab, ids: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores: every split of a piece into two pieces,
    best-scored result first (SentencePiece merges the pair whose result scores highest).
    ids: _token_ids(vocab.tokens), where the caller has it."""
    ids = ids if ids is not None else _token_ids(vocab.tokens)
    plain = (NORMAL, USER_DEFINED, UNUSED)
    candidates = []
    for piece_id, piece in enumerate(vocab.tokens):
        if vocab.type_of(piece_id) not in plain:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                key = (-vocab.scores[piece_id], -len(left), -len(right), ids[left], ids[right])
                candidates.append((key, left, right))
    candidates.sort(key=lambda c: c[0])
    return [(left, right) for _, left, right in candidates]


def sentencepiece_backend(vocab: Vocab) -> BackendTokenizer:
    if vocab.scores is None and vocab.merges is None:
        raise ValueError("a SentencePiece-style vocabulary needs scores or merges")
    ids = _token_ids(vocab.tokens)
    merges = vocab.merges
    if merges is None:  # recovered from the scores once, then read from the cache
        merges = cached_merges(vocab, merges_from_scores, ids)
    unk = vocab.token(vocab.unk_id)
    backend = BackendTokenizer(BPE(vocab=ids, merges=merges, unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
    # llama.cpp puts the dummy space in front of every run of text (also after special tokens),
    # like the Prepend normalizer does per segment; " x" becomes "▁▁x".
    steps = [normalizers.Replace(" ", SPACE)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    return backend


def byte_level_backend(vocab: Vocab) -> BackendTokenizer:
    if vocab.merges is None:
        raise ValueError("a byte-level BPE vocabulary needs merges (tokenizer.ggml.merges)")
    if vocab.pre not in SUPPORTED_PRE:
        raise ValueError(
            f"pre-tokenizer {vocab.pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE)}"
        )
    model = BPE(vocab=_token_ids(vocab.tokens), merges=vocab.merges,
                ignore_merges=vocab.pre in _IGNORE_MERGES)
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _add_special_tokens(backend: BackendTokenizer, vocab: Vocab) -> None:
    """Control and unknown tokens are special (matched whole, skipped when decoding with
    skip_special_tokens); user-defined tokens are matched whole but are ordinary text."""
    special, user = [], []
    for i, token in enumerate(vocab.tokens):
        kind = vocab.type_of(i)
        if kind in (CONTROL, UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    for i in (vocab.bos_id, vocab.eos_id, *vocab.extra_eos_ids):
        token = vocab.token(i)
        if token is not None and vocab.type_of(i) not in (CONTROL, UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
