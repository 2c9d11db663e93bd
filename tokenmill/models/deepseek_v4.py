"""DeepSeek V4: compressed attention (models/deepseek_v4_attention.py) in a stack of layers
joined by manifold-constrained hyper-connections (mHC), with hash-routed and top-k routed
mixtures of experts.

mHC: the residual stream is hc_mult parallel streams. Before each attention or MoE block a
small projection of all streams gives `pre` (how to collapse them into the block's input),
`post` (how to spread its output back) and `comb` (how the streams mix, made doubly
stochastic by Sinkhorn-Knopp iterations); streams' = post * out + comb^T streams.
MoE: sqrt(softplus) scores; "hash_moe" layers take their experts from a fixed table by token
id, "moe" layers the top k of score + bias; weights normalized and scaled; SwiGLU with its
inputs clamped to swiglu_limit, in the shared expert too.

Module names are DeepSeek's published ones (wq_a, attn_sink, ffn.experts.N.w1, hc_attn_fn, ...),
which transformers also writes; its `model.` prefix and renamed head/embedding are accepted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear, embedding
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.slot_cache import PooledContext
from tokenmill.models.config import ModelConfig
from tokenmill.models.deepseek_v4_attention import CSA, HCA, SLIDING, V4Attention
from tokenmill.models.deepseek_v4_config import config_from_hf  # noqa: F401 (the family's)
from tokenmill.models.loading import load_packed

SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
           "softmax": lambda x: x.softmax(-1)}
PACKED = {"w1": ("w13", 0), "w3": ("w13", 1)}
RENAMED = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}


def cache_pools(cfg: ModelConfig, block_size: int) -> list[dict]:
    """The block pools and what each keeps per slot, per layer (values): the raw pool (every
    layer: its K=V vector; compressed layers: their compressor inputs too), kept for the last
    `window` tokens (the sliding window, or the longest span of inputs a window still to be
    pooled needs); then one pool per compressed layer type, one slot per `rate` tokens."""
    v4, d = cfg.family["v4"], cfg.head_dim
    raw, window = [], v4.sliding_window
    for kind in v4.layer_types:
        width = d
        if kind != SLIDING:
            rate = v4.compress_rates[kind]
            width += 2 * (2 * d if kind == CSA else d)
            window = max(window, 2 * rate if kind == CSA else rate)
        if kind == CSA:
            width += 4 * v4.index_head_dim
        raw.append(width)
    pools = [dict(layers=list(range(len(raw))), widths=raw, window=window, rate=1)]
    for kind, width in ((CSA, d + v4.index_head_dim), (HCA, d)):
        layers = [i for i, k in enumerate(v4.layer_types) if k == kind]
        if not layers:
            continue
        rate = v4.compress_rates[kind]
        if rate % block_size and block_size % rate:
            raise ValueError(f"block_size {block_size} and the {kind} compress rate {rate}: "
                             f"one must divide the other")
        pools.append(dict(layers=layers, widths=[width] * len(layers), window=None, rate=rate))
    return pools


def _pool_of(cfg: ModelConfig) -> dict[int, tuple[int, int]]:
    """Layer -> (its compressed pool, its index there), in cache_pools' order."""
    v4, out, pool = cfg.family["v4"], {}, 1
    for kind in (CSA, HCA):
        layers = [i for i, k in enumerate(v4.layer_types) if k == kind]
        out.update({layer: (pool, j) for j, layer in enumerate(layers)})
        pool += bool(layers)
    return out


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w13 = Linear(hidden, [inter, inter])
        self.w2 = Linear(inter, [hidden])
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.w13.sizes, -1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    float32_parameters = ("bias",)

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        v4 = cfg.family["v4"]
        self.v4, self.hashed = v4, hashed
        self.weight = nn.Parameter(torch.empty(v4.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(cfg.vocab_size, v4.num_experts_per_tok,
                                                    dtype=torch.long), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.empty(v4.n_routed_experts))

    def forward(self, x, input_ids):
        scores = SCORING[self.v4.scoring_func](F.linear(x, self.weight))
        if self.hashed:
            index = self.tid2eid[input_ids].long()
        else:
            index = (scores + self.bias).topk(self.v4.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.v4.routed_scaling_factor, index


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        v4 = cfg.family["v4"]
        self.gate = Gate(cfg, v4.mlp_layer_types[layer] == "hash_moe")
        args = (cfg.hidden_size, cfg.intermediate_size, v4.swiglu_limit)
        self.experts = nn.ModuleList(Expert(*args) for _ in range(v4.n_routed_experts))
        self.shared_experts = Expert(*args)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        for e in torch.unique(index).tolist():
            rows, slot = torch.where(index == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out + self.shared_experts(x)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class DeepseekV4DecoderLayer(nn.Module):
    # kept in float32 in a bfloat16 model, as DeepSeek and transformers keep them
    float32_parameters = tuple(f"hc_{site}_{p}" for site in ("attn", "ffn")
                               for p in ("fn", "base", "scale"))

    def __init__(self, cfg: ModelConfig, layer: int, pool_of) -> None:
        super().__init__()
        v4, eps = cfg.family["v4"], cfg.rms_norm_eps
        self.v4, self.eps = v4, eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = V4Attention(cfg, layer, pool_of)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps)
        self.ffn = MoE(cfg, layer)
        n, flat = v4.hc_mult, v4.hc_mult * cfg.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty((2 + n) * n, flat)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty((2 + n) * n)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3)))

    def _mix(self, streams: torch.Tensor, site: str):
        """(post, comb, the collapsed block input) of streams (tokens, n, hidden), in float32."""
        v4, n = self.v4, self.v4.hc_mult
        fn, base, scale = (getattr(self, f"hc_{site}_{p}").float() for p in ("fn", "base", "scale"))
        mixes = F.linear(_unit_rms(streams.flatten(1).float(), self.eps), fn)
        pre, post, comb = mixes.split([n, n, n * n], -1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre = torch.sigmoid(pre * scale[0] + pre_b) + v4.hc_eps
        post = 2 * torch.sigmoid(post * scale[1] + post_b)
        comb = torch.softmax(comb.view(-1, n, n) * scale[2] + comb_b.view(n, n), -1) + v4.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + v4.hc_eps)
        for _ in range(v4.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + v4.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + v4.hc_eps)
        return post, comb, (pre[..., None] * streams).sum(1).to(streams.dtype)

    def forward(self, streams, positions, input_ids, ctx: PooledContext) -> torch.Tensor:
        dtype = streams.dtype
        post, comb, x = self._mix(streams, "attn")
        out = self.attn(self.attn_norm(x), positions, ctx)
        streams = post.to(dtype)[..., None] * out[:, None] + comb.to(dtype).mT @ streams
        post, comb, x = self._mix(streams, "ffn")
        out = self.ffn(self.ffn_norm(x), input_ids)
        return post.to(dtype)[..., None] * out[:, None] + comb.to(dtype).mT @ streams


class DeepseekV4ForCausalLM(nn.Module):
    float32_parameters = ("hc_head_fn", "hc_head_base", "hc_head_scale")

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        v4, pool_of = cfg.family["v4"], _pool_of(cfg)
        self.embed = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i, pool_of)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n = v4.hc_mult
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.empty(n))
        self.hc_head_scale = nn.Parameter(torch.empty(1))
        self.head = Linear(cfg.hidden_size, [cfg.vocab_size])

    def tie_weights(self) -> None:
        pass

    def forward(self, input_ids, positions, ctx: PooledContext) -> torch.Tensor:
        x = self.embed(input_ids)
        streams = x[:, None, :].expand(-1, self.config.family["v4"].hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, input_ids, ctx)
        mixes = F.linear(_unit_rms(streams.flatten(1).float(), self.config.rms_norm_eps),
                         self.hc_head_fn.float())
        pre = torch.sigmoid(mixes * self.hc_head_scale.float() + self.hc_head_base.float())
        pre = pre + self.config.family["v4"].hc_eps
        return self.norm((pre[..., None] * streams).sum(1).to(streams.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden, out_fp32=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def published():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if not name.startswith("mtp."):  # the multi-token-prediction head: unused
                    yield RENAMED.get(name, name), tensor
        load_packed(self, published(), PACKED)


MODELS = {"DeepseekV4ForCausalLM": DeepseekV4ForCausalLM}
