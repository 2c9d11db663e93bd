"""Paged KV cache storage: K and V for every layer, laid out as blocks of token slots.

A token's slot is block_id * block_size + offset. store() encodes a step's new K/V in the
cache's format (float or quantized, see kv_quant.py) and scatters them into their slots;
gather() reads whole blocks through block tables and decodes them to the compute dtype.

A staged format (int4) keeps the K rows of a block that is not full yet in the stage: slots of
block_size rows in the model's dtype, lent by the block manager to each open block (a
sequence's stage table, parallel to its block table). store() writes K rows there and, when a
step writes a block's last row, quantizes the whole block into its codes and per-block params.
Attention reads a query's own block from the stage and earlier blocks quantized.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

from tokenmill.layers.kv_quant import KVFormat, kv_format


def _raw(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors lack CPU index kernels: move their bytes as uint8 instead."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _gather(part: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    return _raw(part)[block_tables].flatten(1, 2).view(part.dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_dtype: str | torch.dtype, block_size: int | None = None) -> int | float:
    """layers x kv_heads x (K and V bytes of a token and head: codes, scales, and int4's
    per-block params spread over the block's tokens, so not always a whole number); block_size
    None: the format's default, as the engine takes it."""
    per = num_layers * num_kv_heads * kv_format(kv_dtype).bytes_per_token_head(head_dim,
                                                                                block_size)
    return int(per) if per == int(per) else per


def latent_bytes_per_token(num_layers: int, latent_dim: int, kv_dtype: str | torch.dtype) -> int:
    """MLA (DeepSeek V2/V3): one latent vector per token per layer (kv_lora_rank + the decoupled
    RoPE key's dims), no separate K and V."""
    fmt = kv_format(kv_dtype)
    return num_layers * sum(w * d.itemsize for w, d in fmt.part_specs(latent_dim))


def stage_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype) -> int:
    """One stage slot: a block's K rows for every layer, in the model's dtype."""
    return num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On the CPU its pages are mapped by the OS on first use (an anonymous
    mapping), so resident memory and start-up time follow the tokens cached, not the budget
    (torch.zeros writes every byte at allocation). Small pages, even where transparent huge
    pages are on for everything: the pool is laid out layer by layer, so one 2 MiB page per
    layer's K and V would make a short request resident for 120 MiB (default model) instead of
    the KiB its tokens use; 16 x 2,048-token and 1 x 8K decode steps measured no faster with
    huge pages (docs/performance.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pool = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        with contextlib.suppress(OSError):
            pool.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pool, dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str | torch.dtype,
        device: torch.device,
        latent: bool = False,
        stage_slots: int = 0,
        stage_dtype: torch.dtype = torch.float32,
    ) -> None:
        """latent: MLA's cache, one vector of head_dim values per token (in k), no v.
        stage_slots: open blocks a staged format (int4) can hold at once."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_dim = head_dim
        self.format: KVFormat = kv_format(kv_dtype)
        self.latent = latent
        self.bytes_per_token = (latent_bytes_per_token(num_layers, head_dim, kv_dtype) if latent
                                else kv_bytes_per_token(num_layers, num_kv_heads, head_dim,
                                                        kv_dtype, block_size))
        prefix = (num_layers, num_blocks, block_size, num_kv_heads)
        # Zeros, not empty: padded slots are masked out, but 0 * NaN would still poison softmax @ V.
        parts = lambda kind: [zeros((*prefix, w), d, device)  # noqa: E731
                              for w, d in self.format.part_specs(head_dim, kind)]
        self.k = parts("k")
        self.v = [] if latent else parts("v")
        self.k_blocks = [zeros((num_layers, num_blocks, num_kv_heads, w), d, device)
                         for w, d in self.format.block_specs(head_dim, "k")]
        self.stage = None
        if self.format.staged:
            self.stage = zeros((num_layers, max(stage_slots, 1), block_size, num_kv_heads,
                                head_dim), stage_dtype, device)

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def staged(self) -> bool:
        return self.format.staged

    def lossless(self, dtype: torch.dtype) -> bool:
        """Whether reading K/V back gives exactly what a `dtype` model wrote."""
        return not self.quantized and self.format.dtype == dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.k + self.v + self.k_blocks)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor | None,
              slots: torch.Tensor, stage_rows: torch.Tensor | None = None) -> None:
        # k, v: (tokens, kv_heads, head_dim); slots: (tokens,); v None for a latent cache.
        # stage_rows (staged formats): each token's row in the stage (slot * block_size + offset)
        for parts, x, kind in ((self.k, k, "k"), (self.v, v, "v")):
            if x is None:
                continue
            if kind == "k" and self.staged:
                self._stage_k(layer, k, slots, stage_rows)
                continue
            for part, value in zip(parts, self.format.encode(x, kind)):
                flat = part[layer].view(-1, *part.shape[3:])  # (slots, kv_heads, width)
                _raw(flat).index_copy_(0, slots, _raw(value))

    def _stage_k(self, layer: int, k: torch.Tensor, slots: torch.Tensor,
                 stage_rows: torch.Tensor) -> None:
        """K rows into the stage; every block whose last row this step writes is quantized."""
        stage = self.stage[layer]
        stage.view(-1, *stage.shape[2:]).index_copy_(0, stage_rows, k.to(stage.dtype))
        last = slots % self.block_size == self.block_size - 1
        if not last.any():
            return
        blocks, staged = slots[last] // self.block_size, stage_rows[last] // self.block_size
        codes, params = self.format.encode_blocks(stage[staged])
        self.k[0][layer].index_copy_(0, blocks, codes)
        self.k_blocks[0][layer].index_copy_(0, blocks, params)

    def gather(self, layer: int, block_tables: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # block_tables: (batch, max_blocks) -> (batch, max_blocks * block_size, kv_heads, head_dim)
        # (a staged format: every block's K as quantized, open blocks' rows meaningless)
        v = self.format.decode(tuple(_gather(p[layer], block_tables) for p in self.v), dtype,
                               "v")
        if self.staged:
            k = self.format.decode_blocks(self.k[0][layer][block_tables],
                                          self.k_blocks[0][layer][block_tables], dtype)
            return k.flatten(1, 2), v
        return self.format.decode(tuple(_gather(p[layer], block_tables) for p in self.k),
                                  dtype), v

    def staged_rows(self, layer: int, stage_slots: torch.Tensor, dtype: torch.dtype
                    ) -> torch.Tensor:
        """(n,) stage slots -> their K rows (n, block_size, kv_heads, head_dim)."""
        return self.stage[layer][stage_slots].to(dtype)
