"""Copy checkpoint tensors into a model by name, filling fused (packed) projections slice by
slice, or whole where the checkpoint already fused them (Phi-3's qkv_proj, gate_up_proj);
every parameter must end up fully set, and shapes must match exactly."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def load_packed(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                packed: dict[str, tuple[str, int]] | None = None) -> None:
    """Under tensor parallelism (distributed/), each tensor is first cut to this rank's part
    (a weight to quantize at load is quantized whole first: per-channel scales stay those of
    the whole row)."""
    from tokenmill.distributed import group as tp

    part = tp.current().shard.tensor if tp.current() is not None else None
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    pending = {name: _num_shards(model, name) for name in params}  # shards still to load
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if tied and name == "lm_head.weight" and "model.embed_tokens.weight" in params:
            name = "model.embed_tokens.weight"
        target, shard = _packed_target(name, packed or {})
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
        owner = _owner(model, target)
        if part is not None:
            tensor = part(name, _quantized_whole(owner, target, tensor))
        if target.endswith(".weight") and getattr(owner, "takes_quantized", lambda t: 0)(tensor):
            owner.load_shard(shard, tensor)  # quantized, or assembled in the layer first
            _loaded(pending[target], shard)
            continue
        dest = params[target]
        if shard is not None:
            dest = dest[_owner(model, target).shard(shard)]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        _loaded(pending[target], shard)
    missing = sorted(name for name, shards in pending.items() if shards)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")


def _quantized_whole(owner: nn.Module, target: str, tensor):
    method = getattr(owner, "quantize_on_load", None)
    if method and target.endswith(".weight") and isinstance(tensor, torch.Tensor):
        from tokenmill.quantization.rtn import quantize

        return quantize(tensor, method)
    return tensor


def _loaded(pending: set, shard: int | None) -> None:
    """Mark a shard loaded; shard None (a whole tensor) fills every shard of the parameter."""
    if shard is None:
        pending.clear()
    else:
        pending.discard(shard)


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0] if "." in param_name else "")


def _num_shards(model: nn.Module, param_name: str) -> set:
    sizes = getattr(_owner(model, param_name), "sizes", None)
    return set(range(len(sizes))) if sizes and len(sizes) > 1 else {None}


def _packed_target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """'model.layers.0.self_attn.q_proj.weight' -> ('...self_attn.qkv_proj.weight', 0)"""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None
