"""The benchmark model in BF16: the default model's GGUF (Q4_1) dequantized and rewritten as a
BF16 GGUF (same metadata, tokenizer and chat template; norms stay F32 as llama.cpp's converter
keeps them). llama.cpp, tokenmill and transformers all load this one file, so every engine runs
the same weights at the same precision.

    python benchmarks/bf16_model.py   # prints the path (cached under $TOKENMILL_HOME/bench)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODEL = "smollm2-135m-instruct"


def bench_dir() -> Path:
    home = Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill"))
    path = home / "bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def bf16_gguf(model: str = DEFAULT_MODEL) -> Path:
    from tokenmill.loaders.resolve import resolve_model

    src = Path(resolve_model(model))
    dst = bench_dir() / (src.stem.split(".")[0] + ".BF16.gguf")
    if not dst.exists():
        tmp = dst.with_suffix(".tmp")
        convert(src, tmp)
        tmp.rename(dst)
    return dst


def convert(src: Path, dst: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                            "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if data.ndim == 1:
            writer.add_tensor(t.name, data)
        else:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(t.name, packed, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    print(bf16_gguf(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
