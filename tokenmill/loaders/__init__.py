"""Model loaders: Hugging Face folders (config.json + safetensors), GGUF files, llama2.c files.

load_model() looks at what it is given and dispatches; every loader returns the model (weights
in place, on the target device) and its ModelConfig.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.models.config import ModelConfig
from tokenmill.models.registry import model_class

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    requested: str, checkpoint_dtype: str | None, device: torch.device
) -> torch.dtype:
    """'auto' keeps the checkpoint's float type (float32 when unknown). On CPU a 16-bit
    checkpoint runs as bfloat16 when tokenmill's CPU kernels run the model being built (they
    stream bf16 weights at memory speed) and as float32 otherwise (PyTorch's bf16/fp16 CPU
    matmuls are slow without AVX-512)."""
    if requested != "auto":
        return _DTYPES[requested]
    dtype = _DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.float32)
    if dtype != torch.float32 and device.type == "cpu":
        from tokenmill.layers import ops
        from tokenmill.layers.kernel_ops import KernelOps

        return torch.bfloat16 if isinstance(ops.current(), KernelOps) else torch.float32
    return dtype


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int) -> nn.Module:
    """Instantiate the architecture without initializing weights: built on the meta device,
    then given uninitialized storage (torch.empty, not Module.to_empty: on meta tensors that
    runs PyTorch's Python decompositions, whose first use imports ~1 s of sympy)."""
    from tokenmill.distributed import group as tp

    cls = model_class(cfg.architecture)
    if tp.current() is not None:  # this rank's share of the model (distributed/sharding.py)
        cfg = tp.current().shard.local
    with torch.device("meta"):
        model = cls(cfg, max_positions=max_positions)
    for module in model.modules():
        fp32 = getattr(module, "float32_parameters", ())  # small ones a family keeps exact
        for name, p in module._parameters.items():
            if p is not None:
                keep = p.dtype if not p.is_floating_point() else (
                    torch.float32 if name in fp32 else dtype)
                t = torch.empty(p.shape, dtype=keep, device=device)
                module._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    model.tie_weights()  # each module got its own tensor, untying shared ones
    if tp.current() is not None:
        from tokenmill.distributed.parallelize import parallelize

        parallelize(model, tp.current(), tp.current().shard)
    if _quantize_on_load:
        from tokenmill.layers.linear import Linear

        for module in model.modules():
            if isinstance(module, Linear):
                module.quantize_on_load = _quantize_on_load
    return model.eval()


def detect_format(path: str) -> str:
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return "hf"
        raise ValueError(f"model folder {path!r} has no config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model {path!r} not found (not a folder, file or known name)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    if path.endswith(".bin"):
        return "llama2c"
    raise ValueError(f"cannot tell the format of {path!r}: not a GGUF, llama2.c .bin or HF folder")


def load_model(path: str, dtype: str, device: torch.device, max_positions: int | None,
               backend=None, quantization: str | None = None
               ) -> tuple[nn.Module, ModelConfig, torch.dtype]:
    """The model at path, its modules built to run on `backend` (layers/ops.py; default: the
    current one); with `quantization` (quantization/rtn.py), float linear weights are
    quantized as they load."""
    from tokenmill.layers import ops

    global _quantize_on_load
    with ops.building(backend or ops.current()):
        _quantize_on_load = quantization
        try:
            return _load_model(path, dtype, device, max_positions)
        finally:
            _quantize_on_load = None


_quantize_on_load: str | None = None  # what build_model tells the linear layers while loading


def _load_model(path: str, dtype: str, device: torch.device,
                max_positions: int | None) -> tuple[nn.Module, ModelConfig, torch.dtype]:
    fmt = detect_format(path)
    if fmt == "hf":
        from tokenmill.loaders.hf import load_hf

        return load_hf(path, dtype, device, max_positions)
    if fmt == "gguf":
        from tokenmill.loaders.gguf import load_gguf

        return load_gguf(path, dtype, device, max_positions)
    from tokenmill.loaders.llama2c import load_llama2c

    return load_llama2c(path, dtype, device, max_positions)
