"""Linear layer whose output may be several projections fused side by side (q|k|v, gate|up):
one matmul reads the input once. `sizes` records each part's width for split()."""

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
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def shard(self, index: int) -> slice:
        """Output rows of the index-th fused projection."""
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def packed_weight(self) -> torch.Tensor:
        """The weight in the C++ GEMM's panel layout (ops.pack_weight), packed on first use and
        again whenever the weight tensor is replaced or written in place."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, ops.pack_weight(self.weight))
        return self._packed[1]

    def forward(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        packed = self.packed_weight() if ops.uses_packed(x, self.weight) else None
        return ops.linear(x, self.weight, self.bias, out_fp32, packed)
