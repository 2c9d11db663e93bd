"""Hugging Face checkpoint folders: config.json plus *.safetensors (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator

import torch
from torch import nn

from tokenmill.loaders import build_model, resolve_dtype
from tokenmill.models.config import ModelConfig


def read_hf_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    config = ModelConfig.from_hf(cfg)
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    return config


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {path!r} (pickled .bin/.pt checkpoints are never "
            "loaded: convert them to safetensors)"
        )
    return files


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor read from the file into its own buffer, one at a time: nothing is mapped,
    so a checkpoint's pages never count in resident memory while it is converted (a mapped
    file does, until it is closed: 1.5x the final RSS when quantizing at load)."""
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8).ljust(8, b"\xff"))
            if size > 100 * 2**20:
                raise ValueError(f"{file} is not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, "
                                     "which tokenmill cannot load")
                start, end = info["data_offsets"]
                buf = bytearray(end - start)
                f.seek(8 + size + start)
                if f.readinto(buf) != len(buf):
                    raise ValueError(f"{file} is truncated: tensor {name!r} runs past its end")
                t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                yield name, t.reshape(info["shape"])


def load_hf(path: str, dtype: str, device: torch.device,
            max_positions: int | None) -> tuple[nn.Module, ModelConfig, torch.dtype]:
    """A pre-quantized checkpoint (AWQ, GPTQ, compressed-tensors: quantization/hf_formats.py)
    keeps its quantization; its activations run in bfloat16 on CPU with the kernels (its
    config's float16 otherwise)."""
    from tokenmill.quantization.hf_formats import checkpoint_format, read

    with open(os.path.join(path, "config.json")) as f:
        fmt = checkpoint_format(json.load(f))
    cfg = read_hf_config(path)
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    model = build_model(cfg, torch_dtype, device, max_positions or cfg.max_position_embeddings)
    weights = hf_weights(path)
    model.load_weights(read(fmt, weights) if fmt else weights)
    return model, cfg, torch_dtype
