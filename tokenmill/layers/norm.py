"""RMSNorm, computed in float32 like Hugging Face so float32 and bf16 results match the oracle.
Called with a residual, it first adds it (the residual stream) and returns both."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops.current()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
