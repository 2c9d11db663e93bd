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

    def shard(self, index: int) -> slice:
        """Output rows of the index-th fused projection."""
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)
