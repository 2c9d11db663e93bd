"""DeepSeek V4 attention over its pooled caches (layers/slot_cache.py).

Every layer: shared-KV multi-query attention (one vector per token is both key and value),
RoPE on each head's last rope dims (interleaved pairs) with the inverse rotation applied to the
output, a learned per-head sink logit in the softmax, and a grouped low-rank output projection.
A query at position t sees the raw tokens t - window < j <= t, and, in a compressed layer, the
entries of the windows complete by t (entry w covers tokens [w * rate, (w + 1) * rate)):
- HCA (heavily compressed, rate 128): every such entry.
- CSA (compressed sparse, rate 4): the index_topk entries the lightning indexer scores highest
  (sum over indexer heads of w_h * relu(q_h . k_s)). Each CSA entry pools 2 x rate tokens: its
  own window's second half-projection and the previous window's first.

The cache holds what the next steps need and nothing else: per token (raw pool, freed beyond
the window) the K=V vector and the compressor's projected inputs, which stay until their
window is pooled; per entry (a compressed pool, one slot per `rate` tokens) the pooled vector
and, for CSA, its indexer key. A step stores its tokens' rows, pools every window its tokens
complete (reading the inputs back from the raw pool, so a chunk boundary, a prefix-cache hit or
a preemption changes nothing), then attends. This is the portable PyTorch path, one sequence
at a time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import rope_attention_factor, rope_inv_freq
from tokenmill.layers.slot_cache import PooledChunk, PooledContext
from tokenmill.models.config import ModelConfig
from tokenmill.models.deepseek import Weight

QUERY_BLOCK = 256  # queries attended at a time: CSA gathers (queries, index_topk, head_dim)
SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")


def rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              factor: float = 1.0, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * len(inv_freq) dims of x (tokens, ..., dim) by interleaved pairs
    (x0, x1), (x2, x3), ...; inverse rotates by -position."""
    r = 2 * inv_freq.numel()
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    if inverse:
        sin = -sin
    shape = (len(x),) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -r:].float()
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat((x[..., :-r], rot.to(x.dtype)), -1)


class Rope(nn.Module):
    def __init__(self, dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", rope_inv_freq(dim, theta, scaling), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.dim, self.theta, self.scaling).to(self.inv_freq.device)

    def forward(self, x, positions, inverse=False):
        return rope_tail(x, positions, self.inv_freq, self.factor, inverse)


class Compressor(nn.Module):
    """Pools each window of `rate` tokens into one entry: a softmax over the window's gates
    (plus a learned bias per offset, `ape`) weights the projected values, then RMSNorm and RoPE
    at the window's first position. overlap (CSA): values and gates are twice as wide, the
    entry pools the previous window's first halves with its own window's second halves."""

    float32_parameters = ("ape",)

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden, [self.width])
        self.wgate = Linear(hidden, [self.width])
        self.ape = nn.Parameter(torch.empty(rate, self.width))
        self.norm = RMSNorm(dim, eps)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What a token leaves in the raw pool: (tokens, 2 * width)."""
        return torch.cat((self.wkv(x), self.wgate(x)), -1)

    def pool(self, rows: torch.Tensor, first: int, count: int, rope: Rope) -> torch.Tensor:
        """Entries first .. first + count - 1 from the inputs of their tokens, `rows`: from
        token (first - 1) * rate (overlap; first * rate without) to (first + count) * rate."""
        r, d = self.rate, self.dim
        kv, gate = rows.float().split(self.width, -1)
        if self.overlap and first == 0:  # window -1 does not exist: weight 0
            kv = torch.cat((kv.new_zeros(r, self.width), kv))
            gate = torch.cat((gate.new_full((r, self.width), -math.inf), gate))
        kv = kv.view(-1, r, self.width)
        gate = gate.view(-1, r, self.width) + self.ape.float()
        if self.overlap:
            kv = torch.cat((kv[:-1, :, :d], kv[1:, :, d:]), 1)  # (count, 2 * rate, dim)
            gate = torch.cat((gate[:-1, :, :d], gate[1:, :, d:]), 1)
        pooled = self.norm((kv * gate.softmax(1)).sum(1))
        positions = torch.arange(first, first + count, device=rows.device) * r
        return rope(pooled, positions)


class Indexer(nn.Module):
    """The lightning indexer: its own compressor (index_head_dim wide) and queries."""

    def __init__(self, cfg: ModelConfig, rate: int) -> None:
        super().__init__()
        v4 = cfg.family["v4"]
        self.heads, self.dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = Linear(v4.q_lora_rank, [self.heads * self.dim])
        self.weights_proj = Linear(cfg.hidden_size, [self.heads])
        self.compressor = Compressor(cfg.hidden_size, self.dim, rate, True, cfg.rms_norm_eps)

    def select(self, x, q_res, positions, rope: Rope, keys, visible):
        """Per query, the indices of its top-k entries (queries, k) and which of them are
        visible (early queries of a chunk see fewer than k)."""
        q = rope(self.wq_b(q_res).view(len(x), self.heads, self.dim), positions)
        scores = torch.relu(torch.einsum("thd,sd->ths", q.float(), keys.float()))
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        total = torch.einsum("ths,th->ts", scores, weights) * self.dim ** -0.5
        total = total.masked_fill(~visible, -math.inf)
        top = total.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return top, visible.gather(1, top)


class V4Attention(nn.Module):
    float32_parameters = ("attn_sink",)

    def __init__(self, cfg: ModelConfig, layer: int, pool_of: dict[int, tuple[int, int]]) -> None:
        super().__init__()
        v4 = cfg.family["v4"]
        self.layer, self.kind = layer, v4.layer_types[layer]
        self.pool, self.pool_layer = pool_of.get(layer, (None, None))  # its compressed pool
        h, d, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.heads, self.dim, self.window = h, d, v4.sliding_window
        self.groups = v4.o_groups
        self.wq_a = Linear(hidden, [v4.q_lora_rank])
        self.q_norm = RMSNorm(v4.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(v4.q_lora_rank, [h * d])
        self.wkv = Linear(hidden, [d])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = Weight(h * d // v4.o_groups, v4.o_groups * v4.o_lora_rank)  # per group
        self.wo_b = Linear(v4.o_groups * v4.o_lora_rank, [hidden])
        self.attn_sink = nn.Parameter(torch.empty(h))
        self.eps = cfg.rms_norm_eps
        theta, scaling = v4.rope_main if self.kind == SLIDING else v4.rope_compress
        self.rope = Rope(v4.rope_dim, theta, scaling)
        if self.kind != SLIDING:
            self.rate = v4.compress_rates[self.kind]
            self.compressor = Compressor(hidden, d, self.rate, self.kind == CSA, self.eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, self.rate)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: PooledContext):
        t, h, d = len(x), self.heads, self.dim
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).view(t, h, d).float()
        q = self.rope((q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype),
                      positions)
        rows = [self.rope(self.norm(self.wkv(x)), positions)]
        if self.kind != SLIDING:
            rows.append(self.compressor.inputs(x))
        if self.kind == CSA:
            rows.append(self.indexer.compressor.inputs(x))
        ctx.caches[0].store(self.layer, ctx.slot_mapping, torch.cat(rows, -1))
        out = torch.empty_like(q)
        for c in ctx.chunks:
            if self.kind != SLIDING:
                self._pool_windows(c, ctx)
            for i in range(c.start, c.end, QUERY_BLOCK):  # bounds CSA's gathered entries
                s = slice(i, min(i + QUERY_BLOCK, c.end))
                out[s] = self._attend(q[s], x[s], q_res[s], positions[s], c, ctx)
        out = self.rope(out, positions, inverse=True).view(t, self.groups, -1)
        w = self.wo_a.weight.view(self.groups, -1, out.shape[-1])
        return self.wo_b(torch.einsum("tgi,goi->tgo", out, w).flatten(1))

    def _pool_windows(self, c: PooledChunk, ctx: PooledContext) -> None:
        """Pool the windows this chunk's tokens complete into the compressed pool."""
        r = self.rate  # window w completes with token (w + 1) * r - 1
        first, end = c.num_computed // r, (c.num_computed + c.num_new) // r
        if end <= first:
            return
        raw = ctx.caches[0]
        lo = max(first - 1, 0) * r if self.kind == CSA else first * r
        rows = raw.read(self.layer, ctx.raw_slots(c, lo, end * r))
        d, cw = self.dim, 2 * self.compressor.width
        entry = [self.compressor.pool(rows[:, d:d + cw], first, end - first, self.rope)]
        if self.kind == CSA:
            entry.append(self.indexer.compressor.pool(rows[:, d + cw:], first, end - first,
                                                      self.rope))
        pool = ctx.caches[self.pool]
        pool.store(self.pool_layer, ctx.pool_slots(c, self.pool, first, end), torch.cat(entry, -1))

    def _attend(self, q, x, q_res, positions, c: PooledChunk, ctx: PooledContext):
        """Softmax over the window's tokens, the visible compressed entries (CSA: each query's
        top-k, gathered) and the sink; values are the keys (shared K=V)."""
        p0, end = c.num_computed, c.num_computed + c.num_new
        qf, scale, lo = q.float(), self.dim ** -0.5, max(p0 - self.window + 1, 0)
        keys = ctx.caches[0].read(self.layer, ctx.raw_slots(c, lo, end))[:, :self.dim].float()
        k_pos = torch.arange(lo, end, device=q.device)
        q_pos = positions[:, None]
        allowed = (k_pos[None, :] <= q_pos) & (k_pos[None, :] > q_pos - self.window)
        parts = [(torch.einsum("thd,sd->ths", qf, keys) * scale, allowed, keys)]
        if self.kind != SLIDING and end // self.rate:
            count = end // self.rate
            entries = ctx.caches[self.pool].read(self.pool_layer,
                                                 ctx.pool_slots(c, self.pool, 0, count))
            visible = torch.arange(count, device=q.device)[None, :] < (q_pos + 1) // self.rate
            values = entries[:, :self.dim].float()
            if self.kind == CSA:  # (queries, k, dim): each query's own entries
                top, visible = self.indexer.select(x, q_res, positions, self.rope,
                                                   entries[:, self.dim:], visible)
                values = values[top]
                parts.append((torch.einsum("thd,tkd->thk", qf, values) * scale, visible, values))
            else:
                parts.append((torch.einsum("thd,sd->ths", qf, values) * scale, visible, values))
        scores = [s.masked_fill(~a[:, None, :], -math.inf) for s, a, _ in parts]
        sink = self.attn_sink.float().view(1, -1, 1).expand(len(q), -1, 1)
        probs = torch.cat(scores + [sink], -1).softmax(-1)
        out, at = 0, 0
        for s, _, v in parts:
            p, at = probs[..., at:at + s.shape[-1]], at + s.shape[-1]
            out = out + (torch.einsum("thk,tkd->thd", p, v) if v.dim() == 3
                         else torch.einsum("ths,sd->thd", p, v))
        return out.to(q.dtype)
