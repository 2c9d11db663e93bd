"""How big the paged KV cache is: blocks from a memory budget, and the limits that follow."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.kv_cache import kv_bytes_per_token
from tokenmill.layers.kv_quant import kv_format
from tokenmill.models.config import ModelConfig

logger = logging.getLogger("tokenmill")

# Without kv_cache_memory the cache may take this share of free memory, and on CPU at most
# DEFAULT_CPU_KV_BYTES (vLLM's CPU backend defaults to 4 GiB too): zeroing and holding much more
# than a workload needs costs seconds at start-up and RAM other programs want.
DEFAULT_MEMORY_FRACTION = 0.5
DEFAULT_CPU_KV_BYTES = 4 * 2**30
DEFAULT_CHUNK_TOKENS = 2048


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA GPU is available")
    return device


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    kv_dtype: str  # a format name: float32, bfloat16, float16, fp8_e4m3, int8, int4
    bytes_per_token: int
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} "
            f"tokens ({self.nbytes / 2**20:.1f} MiB, {self.kv_dtype}, "
            f"{self.bytes_per_token} bytes/token); max_model_len {self.max_model_len}"
        )


def kv_dtype_for(config: EngineConfig, model_dtype: torch.dtype) -> str:
    """The KV format name: 'auto' stores K/V in the model's dtype."""
    if config.kv_cache_dtype == "auto":
        return kv_format(model_dtype).name
    return kv_format(config.kv_cache_dtype).name


def plan_kv_cache(config: EngineConfig, mc: ModelConfig, model_dtype: torch.dtype,
                  device: torch.device) -> KVCachePlan:
    max_len = config.max_model_len or mc.max_position_embeddings
    if max_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
            f"({mc.max_position_embeddings})"
        )
    kv_dtype = kv_dtype_for(config, model_dtype)
    per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                   kv_dtype)
    bs = config.block_size
    block_bytes = per_token * bs
    if config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory ({config.kv_cache_memory} bytes) is smaller than one KV block "
                f"({block_bytes} bytes = {bs} tokens x {per_token} bytes)"
            )
    else:
        wanted = config.max_num_seqs * -(-max_len // bs)
        budget = int(available_memory(device) * DEFAULT_MEMORY_FRACTION)
        if device.type == "cpu":
            budget = min(budget, DEFAULT_CPU_KV_BYTES)
        cap = budget // block_bytes
        num_blocks = max(1, min(wanted, cap))
        if cap < wanted:
            logger.info("KV cache capped at %d blocks (%.1f GiB; max_num_seqs x max_model_len "
                        "would need %d): pass kv_cache_memory to change it", cap,
                        cap * block_bytes / 2**30, wanted)
    if num_blocks * bs < max_len:
        logger.warning("max_model_len lowered from %d to %d: the KV cache holds only %d tokens",
                       max_len, num_blocks * bs, num_blocks * bs)
        max_len = num_blocks * bs
    batched = config.max_num_batched_tokens
    if batched is None:
        batched = DEFAULT_CHUNK_TOKENS if config.enable_chunked_prefill else max(
            max_len, DEFAULT_CHUNK_TOKENS)
    if not config.enable_chunked_prefill and batched < max_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({batched}) must be >= "
            f"max_model_len ({max_len})"
        )
    return KVCachePlan(num_blocks, bs, kv_dtype, per_token, max_len, batched)
