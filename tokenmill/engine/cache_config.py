"""How big the paged KV cache is: blocks from a memory budget, and the limits that follow."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_manager import CacheGroup
from tokenmill.engine.memory import NotEnoughMemory, available_memory, check_kv_budget, gib
from tokenmill.layers.kv_cache import kv_bytes_per_token, latent_bytes_per_token, stage_bytes
from tokenmill.layers.kv_quant import kv_format
from tokenmill.models.config import ModelConfig

logger = logging.getLogger("tokenmill")

# Without kv_cache_memory the cache may take this share of free memory, and on CPU at most
# DEFAULT_CPU_KV_BYTES (vLLM's CPU backend defaults to 4 GiB too): zeroing and holding much more
# than a workload needs costs seconds at start-up and RAM other programs want.
DEFAULT_MEMORY_FRACTION = 0.5
DEFAULT_CPU_KV_BYTES = 4 * 2**30
DEFAULT_CHUNK_TOKENS = 2048
# A staged KV format (int4) lends each open block a stage slot: a slot per running sequence
# plus STAGE_CHUNK_SLOTS for prefill chunks (a chunk that needs more is cut to fit: 16 slots of
# 32-token blocks hold a 512-token chunk), at most an eighth of the budget.
STAGE_CHUNK_SLOTS = 16


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA GPU is available")
    return device


@dataclass(frozen=True)
class KVCachePlan:
    groups: tuple[CacheGroup, ...]  # one block pool per group (see kv_manager.py)
    block_size: int
    kv_dtype: str  # a format name: float32, bfloat16, float16, fp8_e4m3, int8, int4
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.groups[0].num_blocks

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token held in every group (all layers' K and V; a compressed pool's
        entry bytes divided by its rate)."""
        return sum(g.bytes_per_token // g.rate if g.rate > 1 else g.bytes_per_token
                   for g in self.groups)

    @property
    def num_tokens(self) -> int:
        """Tokens of history the cache holds (a pooled cache: its compressed pools cover)."""
        full = [g.num_blocks * g.tokens_per_block(self.block_size) for g in self.groups
                if g.rate > 1]
        return min(full) if full else self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(g.num_blocks * g.block_bytes(self.block_size) + g.stage_slots * g.stage_bytes
                   for g in self.groups)

    def describe(self) -> str:
        def kind(g: CacheGroup) -> str:
            if g.rate > 1:
                return f"compressed (1 entry / {g.rate} tokens)"
            return "sliding-window" if g.window else "full-attention"

        pools = "; ".join(
            f"{len(g.layers)} {kind(g)} layers: {g.num_blocks} blocks x "
            f"{g.tokens_per_block(self.block_size)} = "
            f"{g.num_blocks * g.tokens_per_block(self.block_size)} tokens, {g.bytes_per_token} "
            f"bytes/{'entry' if g.rate > 1 else 'token'}"
            + (f", {g.stage_slots} stage slots of {g.stage_bytes / 2**10:.0f} KiB"
               if g.stage_slots else "") for g in self.groups)
        return (f"KV cache ({self.nbytes / 2**20:.1f} MiB, {self.kv_dtype}): {pools}; "
                f"max_model_len {self.max_model_len}")


def kv_dtype_for(config: EngineConfig, model_dtype: torch.dtype) -> str:
    """The KV format name: 'auto' stores K/V in the model's dtype."""
    if config.kv_cache_dtype == "auto":
        return kv_format(model_dtype).name
    return kv_format(config.kv_cache_dtype).name


def plan_kv_cache(config: EngineConfig, mc: ModelConfig, model_dtype: torch.dtype,
                  device: torch.device) -> KVCachePlan:
    """The pools, their blocks and stage slots, and the limits they set; block_size None
    becomes the KV format's default (plan.block_size)."""
    max_len = config.max_model_len or mc.max_position_embeddings
    if max_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
            f"({mc.max_position_embeddings})"
        )
    kv_dtype = kv_dtype_for(config, model_dtype)
    if config.block_size is None:
        config = replace(config, block_size=kv_format(kv_dtype).default_block_size)
    bs = config.block_size
    if "v4" in mc.family:
        return _pooled_plan(config, mc, model_dtype, max_len, device)
    specs = mc.kv_cache_groups()
    if mc.kv_latent_dim and config.kv_cache_dtype != "auto":
        raise ValueError(f"{mc.architecture} caches MLA latents, which tokenmill keeps in the "
                         f"model's dtype: kv_cache_dtype must be 'auto', got "
                         f"{config.kv_cache_dtype!r}")
    per_token = [latent_bytes_per_token(len(layers), mc.kv_latent_dim, kv_dtype)
                 if mc.kv_latent_dim else
                 kv_bytes_per_token(len(layers), mc.num_key_value_heads, mc.head_dim, kv_dtype,
                                    bs)
                 for layers, _ in specs]
    staged = kv_format(kv_dtype).staged
    slot_bytes = [stage_bytes(len(layers), mc.num_key_value_heads, mc.head_dim, bs, model_dtype)
                  if staged else 0 for layers, _ in specs]
    blocks, stages = _group_blocks(config, specs, [round(p * bs) for p in per_token],
                                   slot_bytes, max_len, device)
    stage_dtype = str(model_dtype).replace("torch.", "")
    groups = tuple(CacheGroup(layers, window, n, p, stage_slots=st, stage_bytes=sb,
                              stage_dtype=stage_dtype)
                   for (layers, window), n, p, st, sb in zip(specs, blocks, per_token, stages,
                                                             slot_bytes))
    if specs[0][1] is None:
        held = blocks[0] * bs
        max_len = _fit(config, max_len, held, f"needs {gib(max_len * per_token[0])} of KV cache "
                       f"for one sequence, but the KV budget ({gib(held * per_token[0])}) holds "
                       f"{held} tokens")
    return KVCachePlan(groups, bs, kv_dtype, max_len, _batched_tokens(config, max_len))


def _fit(config: EngineConfig, max_len: int, held: int, why: str) -> int:
    """max_len, or the `held` tokens the cache holds when fewer: an error if max_model_len was
    asked for, else a warning."""
    if held >= max_len:
        return max_len
    if config.max_model_len is not None:
        raise NotEnoughMemory(f"max_model_len ({max_len}) {why}: raise --kv-cache-memory or "
                              f"lower --max-model-len")
    logger.warning("max_model_len lowered from %d to %d: the KV cache holds only %d tokens",
                   max_len, held, held)
    return held


def _batched_tokens(config: EngineConfig, max_len: int) -> int:
    batched = config.max_num_batched_tokens
    if batched is None:
        batched = DEFAULT_CHUNK_TOKENS if config.enable_chunked_prefill else max(
            max_len, DEFAULT_CHUNK_TOKENS)
    if not config.enable_chunked_prefill and batched < max_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({batched}) must be >= "
            f"max_model_len ({max_len})"
        )
    return batched


def _budget(config: EngineConfig, wanted: int, device: torch.device) -> int:
    if config.kv_cache_memory is not None:
        check_kv_budget(config.kv_cache_memory, device)
        return config.kv_cache_memory
    budget = int(available_memory(device) * DEFAULT_MEMORY_FRACTION)
    if device.type == "cpu":
        budget = min(budget, DEFAULT_CPU_KV_BYTES)
    if budget < wanted:
        logger.info("KV cache capped at %.1f GiB (max_num_seqs x max_model_len would need "
                    "%.1f GiB): pass kv_cache_memory to change it", budget / 2**30,
                    wanted / 2**30)
    return min(budget, wanted)


def _pooled_plan(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, max_len: int,
                 device: torch.device) -> KVCachePlan:
    """DeepSeek V4's pools (models/deepseek_v4.py cache_pools): the raw pool gets what
    max_num_seqs sequences' windows need, twice over (as a sliding pool, for prefix hits), or
    half a budget too small for that; the compressed pools share the rest so that all fill
    at the same number of tokens."""
    from tokenmill.models.deepseek_v4 import cache_pools

    if config.kv_cache_dtype != "auto":
        raise ValueError(f"{mc.architecture} keeps its compressed caches in the model's dtype: "
                         f"kv_cache_dtype must be 'auto', got {config.kv_cache_dtype!r}")
    bs = config.block_size
    pools = cache_pools(mc, bs)
    spb = [bs if p["rate"] == 1 else max(1, bs // p["rate"]) for p in pools]
    slot = [sum(p["widths"]) * dtype.itemsize for p in pools]
    tpb = [n * p["rate"] for n, p in zip(spb, pools)]  # tokens per block
    raw_per_seq = 2 * (-(-pools[0]["window"] // bs) + 2)
    need = [raw_per_seq] + [-(-max_len // t) for t in tpb[1:]]
    budget = _budget(config, config.max_num_seqs * sum(
        n * s * k for n, s, k in zip(need, slot, spb)), device)
    raw_bytes, wanted = slot[0] * bs, config.max_num_seqs * raw_per_seq * slot[0] * bs
    if len(pools) == 1 or budget < wanted:
        wanted = budget if len(pools) == 1 else min(wanted, budget // 2)
    blocks = [max(1, wanted // raw_bytes)]
    rest = budget - blocks[0] * raw_bytes
    per_token = sum(s / p["rate"] for s, p in zip(slot[1:], pools[1:]))
    tokens = rest / per_token if per_token else 0
    blocks += [int(tokens // t) for t in tpb[1:]]
    if min(blocks) < 1:
        raise ValueError(f"kv_cache_memory ({budget} bytes) is too small for one block of "
                         f"each of {mc.architecture}'s cache pools")
    held = min((n * t for n, t in zip(blocks[1:], tpb[1:])), default=max_len)
    max_len = _fit(config, max_len, held, f"does not fit the KV budget ({gib(budget)}), whose "
                   f"compressed pools hold {held} tokens")
    groups = tuple(CacheGroup(p["layers"], p["window"], n, s, p["rate"], k, tuple(p["widths"]))
                   for p, n, s, k in zip(pools, blocks, slot, spb))
    return KVCachePlan(groups, bs, kv_format(dtype).name, max_len,
                       _batched_tokens(config, max_len))


def stage_slots(max_num_seqs: int, budget: int | None, slot_bytes: int,
                whole_prompt: int = 0) -> int:
    """Stage slots of a staged format's pool (0 for others): one per running sequence plus
    STAGE_CHUNK_SLOTS, at most an eighth of the pool's budget (at least 2). whole_prompt:
    without chunked prefill a prompt of max_model_len tokens opens that many blocks in one
    step; they are always there (and the budget must hold them)."""
    if not slot_bytes:
        return 0
    want = max_num_seqs + max(STAGE_CHUNK_SLOTS, whole_prompt)
    if budget is None:
        return want
    return max(2, whole_prompt + 1, min(want, budget // 8 // slot_bytes))


def _group_blocks(config: EngineConfig, specs, block_bytes: list[int], slot_bytes: list[int],
                  max_len: int, device: torch.device) -> tuple[list[int], list[int]]:
    """Blocks and stage slots per pool. A sliding-window pool (the second of two) needs at
    most window / block_size + 2 blocks per running sequence, and gets as much again so that
    the last window blocks of prompts read before stay in the prefix cache (a prefix hit needs
    them: kv_manager.lookup_prefix; without the room, decoding sequences evict them at once);
    the full-history pool gets the rest. Stage slots (staged formats) come off the budget
    first."""
    bs = config.block_size
    per_seq = [-(-max_len // bs) if window is None else -(-window // bs) + 2
               for _, window in specs]
    per_seq[1:] = [2 * n for n in per_seq[1:]]
    whole = 0 if config.enable_chunked_prefill else -(-max_len // bs) + 1
    wanted = sum(config.max_num_seqs * n * b + stage_slots(config.max_num_seqs, None, s, whole)
                 * s for n, b, s in zip(per_seq, block_bytes, slot_bytes))
    budget = _budget(config, wanted, device)
    stages = [stage_slots(config.max_num_seqs, budget // len(specs), s, whole)
              for s in slot_bytes]
    budget -= sum(n * s for n, s in zip(stages, slot_bytes))
    blocks = []
    if len(specs) == 2:  # the sliding pool: twice what max_num_seqs sequences need, <= half
        sliding = min(config.max_num_seqs * per_seq[1] * block_bytes[1], budget // 2)
        blocks.append(max(1, sliding // block_bytes[1]))
        budget -= blocks[-1] * block_bytes[1]
    if budget // block_bytes[0] < 1:
        staged = sum(n * s for n, s in zip(stages, slot_bytes))
        raise ValueError(
            f"kv_cache_memory ({config.kv_cache_memory} bytes) is smaller than one KV block "
            f"({block_bytes[0]} bytes = {bs} tokens x {block_bytes[0] // bs} bytes)"
            + (f" after the int4 stage ({stages[0]} slots, {staged} bytes)" if staged else "")
        )
    return [budget // block_bytes[0], *blocks], stages
