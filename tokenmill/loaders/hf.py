"""Hugging Face checkpoint folders: config.json plus *.safetensors (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
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


def hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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
