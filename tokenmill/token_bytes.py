"""What each token of a text stands for: its text, or its raw bytes when it holds only part of a
character (byte-level BPE and SentencePiece's byte fallback split CJK characters that way)."""

from __future__ import annotations

import functools
import re

from tokenmill.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback token


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (its bytes_to_unicode), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


def piece_bytes(piece: str) -> bytes:
    """The bytes a vocabulary entry of a byte-level or byte-fallback tokenizer stands for."""
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return piece.encode()


def token_values(tok: Tokenizer, ids: list[int]) -> list[str | bytes]:
    """Each token's text as the tokenizer decodes it, or its bytes where that is part of a
    character. Each is decoded after a fixed first token, because decoders drop the leading
    space of a text's first token (SentencePiece's '▁upon' alone decodes to 'upon')."""
    anchor = tok.encode("a", add_special_tokens=False)[-1:]
    before = tok.decode(anchor, skip_special_tokens=False)
    values: list[str | bytes] = []
    for i in ids:
        text = tok.decode(anchor + [i], skip_special_tokens=False)
        if text.startswith(before) and "\ufffd" not in text:
            values.append(text[len(before):])
        else:
            values.append(piece_bytes(tok.backend.id_to_token(i)))
    return values
