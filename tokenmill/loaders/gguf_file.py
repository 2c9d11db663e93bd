"""Opening GGUF files with the `gguf` package: clear errors for broken files, typed metadata.

Parsing a GGUF's metadata is slow in pure Python (seconds for a 50k-token vocabulary), and both
the model loader and the tokenizer loader need it, so the last file opened is kept.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from gguf import GGUFReader, GGUFValueType


def open_gguf(path: str) -> GGUFReader:
    """A reader for path; any parse failure becomes a one-line ValueError."""
    st = os.stat(path)
    return _open_cached(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises many kinds on malformed input
        raise ValueError(f"{path!r} is not a valid GGUF file ({_one_line(e)})") from None
    check_tensor_extents(reader, path, size)
    return reader


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def check_tensor_extents(reader: GGUFReader, path: str, size: int) -> None:
    """Every tensor's bytes must lie inside the file (a truncated download fails here)."""
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"{path!r} is truncated or corrupt: tensor {t.name!r} ends at byte "
                f"{t.data_offset + t.n_bytes}, the file has {size} bytes"
            )


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of them)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception as e:
        raise ValueError(f"GGUF metadata {key!r} is malformed ({_one_line(e)})") from None
    if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
        value = list(value)
    return value
