"""Q/K row order for rotary embeddings: interleaved pairs (Meta/llama.cpp/llama2.c) to the
rotate-half layout of Hugging Face Llama, which models/llama.py uses.

In the interleaved form each head rotates rows (0,1), (2,3), ...; in rotate-half form it rotates
rows (i, i + head_dim/2). llama.cpp's converter reorders HF weights into the interleaved form
(and llama2.c checkpoints are in it natively); this undoes that, per head.
"""

from __future__ import annotations

import torch


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(heads * head_dim, ...) interleaved rows -> rotate-half rows; works for biases too."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot split {rows} rows into {num_heads} rotary heads")
    half = rows // num_heads // 2
    # (heads, pairs, 2, ...) -> (heads, 2, pairs, ...): evens first, then odds, in each head
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
    return w.reshape(weight.shape).contiguous()
