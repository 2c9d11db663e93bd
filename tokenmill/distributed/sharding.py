"""What each rank holds of a decoder (Megatron-style tensor parallelism) and the checkpoint
slices that fill it.

- Column-parallel: q, k, v (by heads) and gate, up (by intermediate rows). Each rank computes
  its heads' attention and its slice of the MLP, with no communication.
- Row-parallel: o and down (their input columns). Each rank's partial output is summed across
  ranks (one all-reduce per projection: two per layer); a bias is added by rank 0 alone.
- Vocabulary-parallel: the embedding table and the LM head by rows (the vocabulary padded to
  a multiple of the size). A lookup outside a rank's rows gives zeros, and the all-reduce
  fills them in; the logits' slices are all-gathered.
- KV heads: split like the query heads when the size divides them. When the size is a multiple
  of their number, each rank keeps the one KV head its query heads read (replicated).
- Everything else (norms, q/k norms) is replicated.

A rank's model is built from `local_config` (its share of heads, KV heads, intermediate size
and vocabulary), so the model code and the KV cache see ordinary, smaller shapes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tokenmill.models.config import ModelConfig
from tokenmill.quantization import BlockQuant, QuantWeight

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model one of `size` ranks builds; ValueError naming what does not divide."""
    if size == 1:
        return cfg
    if cfg.architecture not in SUPPORTED:
        raise ValueError(f"tensor parallelism supports {', '.join(SUPPORTED)}; "
                         f"{cfg.architecture} is not sharded yet")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % size:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by "
                         f"tensor_parallel_size ({size})")
    if kv % size and size % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({size}): "
                         "neither divides the other, so KV heads can be neither split nor "
                         "replicated")
    if cfg.intermediate_size % size:
        raise ValueError(f"intermediate_size ({cfg.intermediate_size}) is not divisible by "
                         f"tensor_parallel_size ({size})")
    return dataclasses.replace(
        cfg, num_attention_heads=heads // size, num_key_value_heads=max(kv // size, 1),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=math.ceil(cfg.vocab_size / size))


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, for the model of config `cfg` (the whole model's)."""

    cfg: ModelConfig
    rank: int
    size: int

    @property
    def local(self) -> ModelConfig:
        return local_config(self.cfg, self.size)

    def q_rows(self) -> slice:
        n = self.local.num_attention_heads * self.cfg.head_dim
        return slice(self.rank * n, (self.rank + 1) * n)

    def kv_rows(self) -> slice:
        kv, d = self.cfg.num_key_value_heads, self.cfg.head_dim
        if kv % self.size == 0:
            n = kv // self.size * d
            return slice(self.rank * n, (self.rank + 1) * n)
        head = self.rank * kv // self.size  # the KV head this rank's query heads share
        return slice(head * d, (head + 1) * d)

    def inter_rows(self) -> slice:
        n = self.local.intermediate_size
        return slice(self.rank * n, (self.rank + 1) * n)

    def vocab_rows(self) -> slice:
        n = self.local.vocab_size
        return slice(self.rank * n, (self.rank + 1) * n)

    def tensor(self, name: str, t):
        """The part of checkpoint tensor `name` (Hugging Face names) this rank holds."""
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        is_bias = name.endswith(".bias")
        if module == "q_proj":
            return _rows(t, self.q_rows())
        if module in ("k_proj", "v_proj"):
            return _rows(t, self.kv_rows())
        if module in ("gate_proj", "up_proj", "c_fc"):
            return _rows(t, self.inter_rows())
        if module in ("qkv_proj", "c_attn"):  # Phi-3, GPT-2: q | k | v fused in the checkpoint
            q, kv = self.cfg.num_attention_heads * self.cfg.head_dim, \
                self.cfg.num_key_value_heads * self.cfg.head_dim
            parts = [_rows(t, slice(0, q)), _rows(t, slice(q, q + kv)),
                     _rows(t, slice(q + kv, q + 2 * kv))]
            rows = [self.q_rows(), self.kv_rows(), self.kv_rows()]
            return _cat([_rows(p, r) for p, r in zip(parts, rows)])
        if module == "gate_up_proj":  # Phi-3: gate | up fused
            inter = self.cfg.intermediate_size
            return _cat([_rows(_rows(t, slice(i * inter, (i + 1) * inter)), self.inter_rows())
                         for i in range(2)])
        if module in ("o_proj", "down_proj", "c_proj"):
            if is_bias:
                return t if self.rank == 0 else torch.zeros_like(t)
            attention = module == "o_proj" or ".attn." in name
            return _cols(t, self.q_rows() if attention else self.inter_rows())
        if module in VOCAB_PARALLEL:
            return _padded_rows(t, self.vocab_rows())
        return t


VOCAB_PARALLEL = ("embed_tokens", "wte", "lm_head")  # (GPT-2's wpe, positions, is replicated)


def _rows(t, rows: slice):
    return t.rows(rows) if isinstance(t, QuantWeight) else t[rows]


def _cat(parts):
    if isinstance(parts[0], QuantWeight):
        return BlockQuant.cat(parts)
    return torch.cat(parts)


def _cols(t, cols: slice):
    if isinstance(t, QuantWeight):
        t = t.block_quant()
        block = t.codes.shape[1] // t.d.shape[1]
        if t.perm is not None or cols.start % block or cols.stop % block:
            raise ValueError("this quantized weight cannot be split by input columns on its "
                             f"blocks of {block} (columns {cols.start}..{cols.stop})")
        b = slice(cols.start // block, cols.stop // block)
        return BlockQuant(t.codes[:, cols], t.d[:, b], t.m[:, b], t.bits)
    return t[:, cols]


def _padded_rows(t, rows: slice):
    """Rows [start, stop) of a vocabulary table, zero rows past its end."""
    part = _rows(t, slice(rows.start, min(rows.stop, t.shape[0])))
    missing = rows.stop - rows.start - part.shape[0]
    if missing <= 0:
        return part
    if isinstance(part, QuantWeight):
        part = part.block_quant()
        k = part.codes.shape[1]
        pad = BlockQuant(torch.zeros(missing, k, dtype=torch.uint8),
                         torch.zeros(missing, part.d.shape[1], dtype=torch.float16),
                         torch.zeros(missing, part.d.shape[1], dtype=torch.float16), part.bits)
        return BlockQuant.cat([part, pad])
    return torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
