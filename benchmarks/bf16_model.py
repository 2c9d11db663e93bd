"""The benchmark model in BF16: the default model's GGUF (Q4_1) dequantized and rewritten as a
BF16 GGUF (same metadata, tokenizer and chat template; norms stay F32 as llama.cpp's converter
keeps them). llama.cpp, tokenmill and transformers all load this one file, so every engine runs
the same weights at the same precision.

    python benchmarks/bf16_model.py   # prints the path (cached under $TOKENMILL_HOME/bench)
"""

from __future__ import annotations

import json
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


def model_stem(path: Path) -> str:
    """A GGUF file's name without ".gguf" and its type: "SmolLM2-135M-Instruct.Q4_1.gguf" ->
    "SmolLM2-135M-Instruct", "tinyllama-1.1b-random.BF16.gguf" -> "tinyllama-1.1b-random"."""
    return path.stem.rsplit(".", 1)[0]


def bf16_gguf(model: str = DEFAULT_MODEL) -> Path:
    from tokenmill.loaders.resolve import resolve_model

    src = Path(resolve_model(model))
    dst = bench_dir() / (model_stem(src) + ".BF16.gguf")
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


def bf16_hf_folder(model: str = DEFAULT_MODEL) -> Path:
    """The same BF16 weights as a Hugging Face folder (safetensors, tokenizer, chat template),
    written by transformers from the BF16 GGUF: for engines that take no GGUF (vLLM)."""
    gguf_path = bf16_gguf(model)
    dst = bench_dir() / (model_stem(gguf_path) + "-BF16-hf")
    if not (dst / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw = {"gguf_file": gguf_path.name}
        from safetensors.torch import save_file

        hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.bfloat16, **kw)
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.mkdir(exist_ok=True)
        # save_pretrained refuses models loaded from GGUF: write the tensors ourselves
        tied = hf.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)  # plain bf16 weights now
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        hf.generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf_path.parent, **kw).save_pretrained(tmp)
        tmp.rename(dst)
    return dst


if __name__ == "__main__":
    print(bf16_gguf(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
