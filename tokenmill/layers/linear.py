"""Linear layer whose output may be several projections fused side by side (q|k|v, gate|up):
one matmul reads the input once. `sizes` records each part's width for split(). Also the
embedding table, built like the other layers: uninitialized, for the checkpoint to fill."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import ops


class Linear(nn.Module):
    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.sizes = list(sizes)
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(sizes))) if bias else None
        self.ops = ops.current()
        self._prepared: tuple[tuple, object] | None = None

    def shard(self, index: int) -> slice:
        """Output rows of the index-th fused projection."""
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def prepared(self):
        """What the op implementation precomputes from the weight (the C++ GEMM's packed
        panels and its GEMM plan), computed on first use and again whenever the weight or bias
        is replaced or written in place."""
        key = tuple((t.data_ptr(), t._version) for t in (self.weight, self.bias) if t is not None)
        if self._prepared is None or self._prepared[0] != key:
            self._prepared = (key, self.ops.prepare_linear(self.weight, self.bias))
        return self._prepared[1]

    def forward(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        return self.ops.linear(x, self, out_fp32)


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding without its random init (the checkpoint overwrites it; under the meta
    device the init also imported ~1 s of PyTorch's reference decompositions at start)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
