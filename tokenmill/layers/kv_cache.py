"""Paged KV cache storage: K and V for every layer, laid out as blocks of token slots.

A token's slot is block_id * block_size + offset. store() encodes a step's new K/V in the
cache's format (float or quantized, see kv_quant.py) and scatters them into their slots;
gather() reads whole blocks through block tables and decodes them to the compute dtype.
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
                       kv_dtype: str | torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x bytes per head (head_dim x element bytes + scales)."""
    return 2 * num_layers * num_kv_heads * kv_format(kv_dtype).bytes_per_head(head_dim)


def latent_bytes_per_token(num_layers: int, latent_dim: int, kv_dtype: str | torch.dtype) -> int:
    """MLA (DeepSeek V2/V3): one latent vector per token per layer (kv_lora_rank + the decoupled
    RoPE key's dims), no separate K and V."""
    return num_layers * kv_format(kv_dtype).bytes_per_head(latent_dim)


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
    ) -> None:
        """latent: MLA's cache, one vector of head_dim values per token (in k), no v."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format: KVFormat = kv_format(kv_dtype)
        self.latent = latent
        self.bytes_per_token = (latent_bytes_per_token(num_layers, head_dim, kv_dtype) if latent
                                else kv_bytes_per_token(num_layers, num_kv_heads, head_dim,
                                                        kv_dtype))
        prefix = (num_layers, num_blocks, block_size, num_kv_heads)
        # Zeros, not empty: padded slots are masked out, but 0 * NaN would still poison softmax @ V.
        self.k = [zeros((*prefix, w), d, device) for w, d in self.format.part_specs(head_dim)]
        self.v = [] if latent else [zeros(p.shape, p.dtype, device) for p in self.k]

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    def lossless(self, dtype: torch.dtype) -> bool:
        """Whether reading K/V back gives exactly what a `dtype` model wrote."""
        return not self.quantized and self.format.dtype == dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.k + self.v)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor | None,
              slots: torch.Tensor) -> None:
        # k, v: (tokens, kv_heads, head_dim); slots: (tokens,); v None for a latent cache
        for parts, x in ((self.k, k), (self.v, v)) if v is not None else ((self.k, k),):
            for part, value in zip(parts, self.format.encode(x)):
                flat = part[layer].view(-1, *part.shape[3:])  # (slots, kv_heads, width)
                _raw(flat).index_copy_(0, slots, _raw(value))

    def gather(self, layer: int, block_tables: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # block_tables: (batch, max_blocks) -> (batch, max_blocks * block_size, kv_heads, head_dim)
        k = self.format.decode(tuple(_gather(p[layer], block_tables) for p in self.k), dtype)
        v = self.format.decode(tuple(_gather(p[layer], block_tables) for p in self.v), dtype)
        return k, v
