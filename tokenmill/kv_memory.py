"""KV cache memory arithmetic for any model shape: bytes per token for each KV dtype, totals
per context and per batch, and how many sequences a memory budget holds. The per-token bytes
come from the same function the engine sizes its cache with; int4's stage (the open blocks'
keys in the model's dtype, engine/cache_config.py) comes off the budget as the engine takes
it, for a bfloat16 model with the default max_num_seqs unless told otherwise."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenmill.layers.kv_cache import kv_bytes_per_token, latent_bytes_per_token, stage_bytes
from tokenmill.layers.kv_quant import KV_FORMATS, kv_format
from tokenmill.models.config import ModelConfig


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int
    sliding_window: int | None = None
    sliding_layers: int = 0  # layers using the window; the others keep the whole history
    latent_dim: int | None = None  # MLA: one latent of this many values per token per layer
    expanded_dims: int = 0  # MLA: per head, the K + V dims the latent stands for

    def bytes_per_token(self, dtype, layers: int | None = None,
                        block_size: int | None = None) -> int | float:
        layers = self.num_layers if layers is None else layers
        if self.latent_dim:
            return latent_bytes_per_token(layers, self.latent_dim, dtype)
        return kv_bytes_per_token(layers, self.num_kv_heads, self.head_dim, dtype, block_size)

    def mha_bytes_per_token(self, dtype, block_size: int | None = None) -> int | float:
        """Per-head K and V for every attention head (for MLA: the expanded K and V)."""
        if self.latent_dim:
            return latent_bytes_per_token(self.num_layers, self.num_heads * self.expanded_dims,
                                          dtype)
        return kv_bytes_per_token(self.num_layers, self.num_heads, self.head_dim, dtype,
                                  block_size)

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers


# Published shapes, so users can size hardware without downloading anything.
KNOWN_SHAPES = {s.name: s for s in [
    Shape("llama-2-7b", 32, 32, 32, 128, 4096),
    Shape("llama-2-70b", 80, 64, 8, 128, 4096),
    Shape("llama-3-8b", 32, 32, 8, 128, 8192),
    Shape("llama-3.1-70b", 80, 64, 8, 128, 131072),
    Shape("llama-3.1-405b", 126, 128, 8, 128, 131072),
    Shape("mistral-7b-v0.1", 32, 32, 8, 128, 32768, sliding_window=4096, sliding_layers=32),
    Shape("qwen2.5-7b", 28, 28, 4, 128, 32768),
    Shape("smollm2-135m", 30, 9, 3, 64, 8192),
]}


def shape_from_config(name: str, cfg: ModelConfig) -> Shape:
    groups = cfg.kv_cache_groups()
    sliding = groups[-1][0] if groups[-1][1] is not None else []
    window = groups[-1][1] if sliding else None
    mla = cfg.family.get("mla")
    return Shape(name, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                 cfg.head_dim, cfg.max_position_embeddings, window, len(sliding),
                 cfg.kv_latent_dim, mla.qk_nope_head_dim + mla.qk_rope_head_dim
                 + mla.v_head_dim if mla else 0)


def load_shape(model: str) -> Shape:
    """A known name, an HF folder (config.json is enough), or a GGUF file (metadata only)."""
    if model in KNOWN_SHAPES:
        return KNOWN_SHAPES[model]
    if os.path.isdir(model):
        from tokenmill.loaders.hf import read_hf_config

        return shape_from_config(os.path.basename(os.path.normpath(model)), read_hf_config(model))
    from tokenmill.loaders.resolve import read_model_config, resolve_model

    path = resolve_model(model)
    return shape_from_config(os.path.basename(path), read_model_config(path))


def held_tokens(shape: Shape, context: int, block_size: int) -> tuple[int, int]:
    """Token slots one sequence of `context` tokens holds in the engine, for a full-history
    layer and for a sliding-window layer: whole blocks, and for the latter only the blocks the
    window can still see (at most two more than the window)."""
    blocks = -(-context // block_size)
    window_blocks = blocks
    if shape.sliding_window is not None:
        window_blocks = min(blocks, shape.sliding_window // block_size + 2)
    return blocks * block_size, window_blocks * block_size


def report(shape: Shape, context: int, batch: int, memory: int | None,
           block_size: int | None = None, model_dtype=None, max_num_seqs: int = 32
           ) -> list[dict]:
    """Per KV dtype: bytes per token and per context; with a memory budget, the sequences
    and tokens it holds (int4: after the stage for a `model_dtype` model, bfloat16 if None).
    block_size None: each format's default, as the engine takes it."""
    import torch

    from tokenmill.engine.cache_config import stage_slots

    rows = []
    for dtype in KV_FORMATS:
        if shape.latent_dim and dtype != "bfloat16" and dtype != "float32":
            continue  # MLA latents stay in the model's dtype (engine/cache_config.py)
        bs = block_size or kv_format(dtype).default_block_size
        full, window = held_tokens(shape, context, bs)
        per_token = shape.bytes_per_token(dtype, block_size=bs)
        mha = shape.mha_bytes_per_token(dtype, bs)
        per_layer = shape.bytes_per_token(dtype, 1, bs)
        per_context = round((shape.full_layers * full + shape.sliding_layers * window)
                            * per_layer)
        row = {"kv_dtype": dtype, "block_size": bs, "bytes_per_token": per_token,
               "mha_bytes_per_token": mha,
               "per_context_bytes": per_context, "per_batch_bytes": per_context * batch}
        if memory is not None:
            left = memory
            if kv_format(dtype).staged and not shape.latent_dim:
                slot = stage_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                   bs, model_dtype or torch.bfloat16)
                row["stage_bytes"] = stage_slots(max_num_seqs, memory, slot) * slot
                left -= row["stage_bytes"]
            row["max_sequences"] = left // per_context
            row["tokens_in_budget"] = left // round(per_token * bs) * bs
        rows.append(row)
    return rows


def formula(shape: Shape) -> str:
    """The bfloat16 per-token arithmetic, spelled out."""
    per_token = shape.bytes_per_token("bfloat16")
    if shape.latent_dim:
        return (f"{shape.num_layers} layers x {shape.latent_dim} latent values (MLA: "
                f"kv_lora_rank + rope dims, no K/V heads) x 2 bytes (bfloat16) = "
                f"{per_token:,} bytes")
    return (f"2 (K,V) x {shape.num_layers} layers x {shape.num_kv_heads} kv_heads x "
            f"{shape.head_dim} head_dim x 2 bytes (bfloat16) = {per_token:,} bytes")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def print_report(shape: Shape, context: int, batch: int, memory: int | None,
                 block_size: int | None, as_json: bool = False, model_dtype=None) -> None:
    rows = report(shape, context, batch, memory, block_size, model_dtype)
    if as_json:
        print(json.dumps({"model": shape.__dict__, "context": context, "batch": batch,
                          "memory": memory, "block_size": block_size, "rows": rows}))
        return
    gqa = shape.num_heads // shape.num_kv_heads
    kv = (f"MLA: one {shape.latent_dim}-value latent per token and layer for all heads"
          if shape.latent_dim else
          f"{shape.num_kv_heads} KV heads (GQA x{gqa}), head_dim {shape.head_dim}")
    print(f"{shape.name}: {shape.num_layers} layers, {shape.num_heads} heads, {kv}"
          + (f", sliding window {shape.sliding_window} on {shape.sliding_layers} of them"
             if shape.sliding_window else ""))
    print(f"per token: {formula(shape)}")
    print(f"context {context:,} tokens, batch {batch}"
          + (f", budget {human(memory)}" if memory else ""))
    header = ["kv_dtype", "block", "bytes/token", "MHA bytes/token", "per context", "per batch"]
    if memory is not None:
        header += ["max seqs", "tokens in budget"]
    table = [header]
    for r in rows:
        line = [r["kv_dtype"], str(r["block_size"]), f"{r['bytes_per_token']:,}",
                f"{r['mha_bytes_per_token']:,}",
                human(r["per_context_bytes"]), human(r["per_batch_bytes"])]
        if memory is not None:
            line += [f"{r['max_sequences']:,}", f"{r['tokens_in_budget']:,}"]
        table.append(line)
    print_table(table)


def print_table(table: list[list[str]]) -> None:
    """A header row, a rule, then the rows: the first column left-aligned, the others right."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, r in enumerate(table):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
