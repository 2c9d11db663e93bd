"""The BF16 benchmark model's shape with random weights, for a machine the real file cannot
reach (a lent machine with no package index, and a working tree too small to carry 270 MB).

Speed only: every GEMM, attention and byte moved is the same as with the real weights (same
tensors, shapes, dtypes, tokenizer and metadata), so engines compare the same way; the text is
noise, and nothing lossy may be judged on it. The benchmarks all run with ignore_eos.

    python benchmarks/shape_model.py skeleton SKEL.gguf   # here: metadata + tensor list, ~2 MB
    python benchmarks/shape_model.py fill SKEL.gguf       # there: prints the random model's path
    python benchmarks/compare_llamacpp.py --model "$(that path)"   # and the other benchmarks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bf16_model import DEFAULT_MODEL, bench_dir, bf16_gguf, model_stem  # noqa: E402

TENSORS = "tokenmill.shape_model.tensors"
STEM = "tokenmill.shape_model.stem"  # the real file's name: SmolLM2-135M-Instruct


def _copy_fields(reader, writer, skip: tuple[str, ...] = ()) -> None:
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *skip):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)


def _write(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def skeleton(dst: Path, model: str = DEFAULT_MODEL) -> None:
    """The BF16 model's metadata (tokenizer, chat template, config) and its tensor list."""
    import gguf

    path = bf16_gguf(model)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    _copy_fields(reader, writer)
    specs = [[t.name, [int(d) for d in reversed(t.shape)]] for t in reader.tensors]
    writer.add_string(TENSORS, json.dumps(specs))
    writer.add_string(STEM, model_stem(path))
    _write(writer)


def fill(src: Path, seed: int = 0) -> Path:
    """A BF16 GGUF with the skeleton's metadata: matrices N(0, 0.02), vectors (norms) ones."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    stem = reader.fields[STEM].contents()
    dst = bench_dir() / f"{stem}-random.BF16.gguf"
    writer = gguf.GGUFWriter(str(dst.with_suffix(".tmp")),
                             reader.fields["general.architecture"].contents())
    _copy_fields(reader, writer, skip=(TENSORS, STEM, "general.name"))
    name = reader.fields["general.name"].contents() if "general.name" in reader.fields else stem
    writer.add_name(f"{name} (random weights)")
    rng = np.random.default_rng(seed)
    for tensor, shape in json.loads(reader.fields[TENSORS].contents()):
        if len(shape) == 1:
            writer.add_tensor(tensor, np.ones(shape, dtype=np.float32))
            continue
        data = rng.standard_normal(shape, dtype=np.float32) * 0.02
        bf16 = (data.view(np.uint32) >> 16).astype(np.uint16)  # truncated: any bf16 will do
        writer.add_tensor(tensor, bf16.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
    _write(writer)
    dst.with_suffix(".tmp").rename(dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["skeleton", "fill"])
    ap.add_argument("path", type=Path, help="the skeleton to write (skeleton) or read (fill)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    if args.action == "skeleton":
        skeleton(args.path, args.model)
    else:
        print(fill(args.path))


if __name__ == "__main__":
    main()
