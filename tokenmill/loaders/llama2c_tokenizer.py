"""llama2.c tokenizer files (`tokenizer.bin`, `tok512.bin`): a SentencePiece vocabulary.

Layout: int32 max_token_length, then per token: float32 score, int32 byte length, the bytes.
llama2.c's exporter wrote `▁` as a plain space and BOS/EOS as "\\n<s>\\n" / "\\n</s>\\n"; both
are undone here so the vocabulary reads like the SentencePiece model it came from.
"""

from __future__ import annotations

import re
import struct

from tokenmill.loaders.vocab import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, Vocab, build_tokenizer
from tokenmill.tokenizer import Tokenizer

_ENTRY = struct.Struct("<fi")
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2  # fixed by llama2.c's SentencePiece training setup


def read_llama2c_vocab(path: str) -> Vocab:
    with open(path, "rb") as f:
        data = f.read()
    bad = ValueError(f"{path!r} is not a llama2.c tokenizer file")
    if len(data) < 4:
        raise bad
    (max_len,) = struct.unpack_from("<i", data)
    pieces, scores, offset = [], [], 4
    while offset < len(data):
        if offset + _ENTRY.size > len(data):
            raise bad
        score, length = _ENTRY.unpack_from(data, offset)
        offset += _ENTRY.size
        if not 0 <= length <= max_len or offset + length > len(data):
            raise bad
        try:
            pieces.append(data[offset:offset + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise bad from None
        scores.append(score)
        offset += length
    if len(pieces) <= EOS_ID:
        raise bad
    pieces[BOS_ID], pieces[EOS_ID] = pieces[BOS_ID].strip("\n"), pieces[EOS_ID].strip("\n")
    pieces = [p.replace(" ", SPACE) for p in pieces]
    return Vocab(kind="llama", tokens=pieces, types=[_type(i, p) for i, p in enumerate(pieces)],
                 scores=scores, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, add_bos=True)


def _type(token_id: int, piece: str) -> int:
    if token_id == UNK_ID:
        return UNKNOWN
    if token_id in (BOS_ID, EOS_ID):
        return CONTROL
    return BYTE if _BYTE_PIECE.fullmatch(piece) else NORMAL


def load_llama2c_tokenizer(path: str) -> Tokenizer:
    return build_tokenizer(read_llama2c_vocab(path))
