"""DeepSeek V2 and V3: Multi-head Latent Attention (MLA) over a latent paged cache, and a
mixture of experts with shared experts and (group-limited) top-k routing, dense MLPs in the
first layers, YaRN RoPE. V3 routes on sigmoid scores with a bias that only steers the choice
(noaux_tc); V2 on softmax scores, greedy or group-limited by each group's best expert.

MLA (DeepSeek-V2 paper, section 2.1). Per token and layer the cache keeps one latent:
c = norm(x W_DKV) (kv_lora_rank values) and the decoupled RoPE key k_r (qk_rope_head_dim
values, shared by all heads). Never the per-head K and V. Each head's key is
[c W_UK_h, k_r] and its value c W_UV_h (W_UK, W_UV: kv_b_proj's two halves).
- Decode reads only the latent cache, in the absorbed form: the query's no-RoPE part is
  projected into latent space (q W_UK_h^T), the scores are q_lat . c + q_r . k_r, the
  output is (softmax . c) W_UV_h. Per step it reads kv_lora_rank + rope values per cached
  token for all heads at once, instead of heads x (qk + v) head dims.
- Prefill expands: the chunk's history latents go through kv_b_proj into per-head K and V
  once, and the chunk attends causally with SDPA (many queries share each expanded key, so
  expanding costs less than absorbing for every query).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionContext, last_layer_rows
from tokenmill.layers.linear import Linear, embedding
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, yarn_mscale
from tokenmill.models.config import ModelConfig, as_list
from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tokenmill.models.loading import load_packed

PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclasses.dataclass(frozen=True)
class MLA:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclasses.dataclass(frozen=True)
class MoE:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    topk_method: str  # "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2)


class Weight(nn.Module):
    """A bare (out, in) weight: kv_b_proj, which MLA reads as two per-head matrices (never
    quantized at load, unlike Linear)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        m: MLA = cfg.family["mla"]
        self.m, self.layer, self.heads = m, layer_idx, cfg.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = Linear(hidden, [self.heads * qk])
        else:
            self.q_a_proj = Linear(hidden, [m.q_lora_rank], bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, [self.heads * qk])
        self.kv_a_proj_with_mqa = Linear(hidden, [m.kv_lora_rank + m.qk_rope_head_dim], bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Weight(m.kv_lora_rank, self.heads * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(self.heads * m.v_head_dim, [hidden], bias)
        self.scale = cfg.attention_scale
        self.absorb = True  # decode in latent space (False: expand the history, to compare)
        self.ops = ops.current()

    def forward(self, x, positions, rotary: RotaryEmbedding, ctx: AttentionContext, keep=None):
        """keep: the rows whose output is wanted (AttentionContext.rows_to_keep), else all."""
        m, t, h = self.m, x.shape[0], self.heads
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, h, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c, k_rope = self.kv_a_layernorm(c), k_rope.reshape(t, 1, -1)
        if m.rope_interleave:  # pairs (x0, x1), (x2, x3) ... to rotate-half's halves
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = rotary(positions, q_rope.contiguous(), k_rope.contiguous())
        latent = torch.cat([c, k_rope.reshape(t, -1)], -1)
        ctx.kv_cache.store(self.layer, latent[:, None, :], None, ctx.slot_mapping)
        pages = ctx.kv_cache.k[0][self.layer]  # (blocks, block_size, 1, latent)
        out = x.new_empty(t, h, m.v_head_dim)
        d = ctx.num_decode_tokens
        if d:
            decode = self._absorbed if self.absorb else self._expanded_decode
            out[:d] = decode(q_nope[:d], q_rope[:d], pages, ctx)
        for chunk in ctx.prefills:
            s, e = chunk.start, chunk.end
            out[s:e] = self._expanded(q_nope[s:e], q_rope[s:e], pages, chunk)
        out = out.reshape(t, -1)
        return self.o_proj(out if keep is None else out[keep])

    def _uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.heads, -1, self.m.kv_lora_rank)
        return w[:, :self.m.qk_nope_head_dim], w[:, self.m.qk_nope_head_dim:]

    def _absorbed(self, q_nope, q_rope, pages, ctx) -> torch.Tensor:
        """Decode rows: attention computed in latent space, reading only the cached latents."""
        rows = q_nope.shape[0]
        w_uk, w_uv = self._uk_uv()
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        out = self.ops.latent_decode_attention(  # the C++ kernel reads the pages in place
            torch.cat([q_lat, q_rope], -1), pages, ctx.decode_block_tables,
            ctx.decode_seq_lens, self.scale)
        if out is not None:
            return torch.einsum("thr,hvr->thv", out[..., :self.m.kv_lora_rank], w_uv)
        kv = pages[ctx.decode_block_tables].reshape(rows, -1, pages.shape[-1])  # (rows, S, L)
        c, k_rope = kv.split([self.m.kv_lora_rank, self.m.qk_rope_head_dim], -1)
        scores = (torch.einsum("thr,tsr->ths", q_lat, c)
                  + torch.einsum("thd,tsd->ths", q_rope, k_rope)).float() * self.scale
        allowed = ctx.decode_mask(None)[:, 0]  # (rows, 1, S)
        probs = scores.masked_fill(~allowed, -math.inf).softmax(-1).to(c.dtype)
        return torch.einsum("thr,hvr->thv", torch.einsum("ths,tsr->thr", probs, c), w_uv)

    def _expanded_decode(self, q_nope, q_rope, pages, ctx) -> torch.Tensor:
        """Decode rows the naive way, for benchmarks/mla_decode.py: every cached latent
        expanded to per-head K and V (heads x (qk + v) values per token), then attention."""
        m, rows = self.m, q_nope.shape[0]
        kv = pages[ctx.decode_block_tables].reshape(rows, -1, pages.shape[-1])
        c, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_nope, v = F.linear(c, self.kv_b_proj.weight).unflatten(-1, (self.heads, -1)).split(
            [m.qk_nope_head_dim, m.v_head_dim], -1)  # (rows, S, heads, dn / dv)
        scores = (torch.einsum("thd,tshd->ths", q_nope, k_nope)
                  + torch.einsum("thd,tsd->ths", q_rope, k_rope)).float() * self.scale
        allowed = ctx.decode_mask(None)[:, 0]
        probs = scores.masked_fill(~allowed, -math.inf).softmax(-1).to(c.dtype)
        return torch.einsum("ths,tshv->thv", probs, v)

    def _expanded(self, q_nope, q_rope, pages, chunk) -> torch.Tensor:
        """A prefill chunk: its history's latents expanded to per-head K and V, causal SDPA."""
        m, n, kv_len = self.m, q_nope.shape[0], chunk.kv_len
        kv = pages[chunk.block_table].reshape(-1, pages.shape[-1])[:kv_len]
        c, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_nope, v = F.linear(c, self.kv_b_proj.weight).view(kv_len, self.heads, -1).split(
            [m.qk_nope_head_dim, m.v_head_dim], -1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.heads, -1)], -1)
        q = torch.cat([q_nope, q_rope], -1)
        q_pos = torch.arange(n, device=q.device) + chunk.num_computed
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class Router(nn.Module):
    """V3 (noaux_tc): sigmoid scores; the choice adds e_score_correction_bias, keeps the
    topk_group groups with the best two-expert sums, then the top k experts; the weights are
    the unbiased scores, normalized and scaled. V2: softmax scores, the top k (greedy), or the
    top k of the topk_group groups with the best single expert; weights scaled only. In
    float32, as transformers."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.moe: MoE = cfg.family["moe"]
        e = self.moe.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size), requires_grad=False)
        if self.moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(e), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())  # (tokens, experts)
        if moe.topk_method != "noaux_tc":
            return self._v2(logits.softmax(-1))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(len(x), moe.n_group, -1)
        best = groups.topk(2, dim=-1).values.sum(-1).topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(groups[..., 0]).scatter_(1, best, 1).bool()
        choice = groups.masked_fill(~keep[..., None], -math.inf).view(len(x), -1)
        index = choice.topk(moe.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, index)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, index

    def _v2(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.topk_method == "group_limited_greedy":
            groups = scores.view(len(scores), moe.n_group, -1)
            best = groups.max(-1).values.topk(moe.topk_group, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0]).scatter_(1, best, 1).bool()
            scores = groups.masked_fill(~keep[..., None], 0.0).view(len(scores), -1)
        weights, index = scores.topk(moe.num_experts_per_tok, dim=-1)
        return weights * moe.routed_scaling_factor, index


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe: MoE = cfg.family["moe"]
        expert = dataclasses.replace(cfg, intermediate_size=moe.moe_intermediate_size)
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(LlamaMLP(expert) for _ in range(moe.n_routed_experts))
        self.shared_experts = LlamaMLP(dataclasses.replace(
            cfg, intermediate_size=moe.moe_intermediate_size * moe.n_shared_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not len(x):  # a last layer that keeps no rows (AttentionContext.rows_to_keep)
            return x
        weights, index = self.gate(x)
        out = torch.zeros_like(x)
        for e in torch.unique(index).tolist():  # each expert once, on its tokens
            rows, slot = torch.where(index == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out + self.shared_experts(x)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual block (its forward) with MLA and, past the dense first
    layers, the MoE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = MLAttention(cfg, layer_idx)
        dense = layer_idx < cfg.family["moe"].first_k_dense_replace
        self.mlp = LlamaMLP(cfg) if dense else DeepseekMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.family["mla"].qk_rope_head_dim, max_positions,
                                          cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        keep = last_layer_rows(ctx, x)  # the last layer's rows past attention (llama.py)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary_emb, ctx,
                                keep if i == len(self.layers) - 1 else None)
        return self.norm(x, residual)[0]


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed(self, weights, PACKED)


MODELS = {"DeepseekV2ForCausalLM": DeepseekV3ForCausalLM,
          "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    if rope.get("rope_type", "default") != "default":
        scaling = rope
    mla = MLA(cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
              cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg.get("rope_interleave", True))
    moe = MoE(cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
              cfg.get("n_shared_experts") or 0, cfg.get("n_group") or 1,
              cfg.get("topk_group") or 1, cfg.get("routed_scaling_factor", 1.0),
              cfg.get("norm_topk_prob", True), cfg.get("first_k_dense_replace", 0),
              cfg.get("topk_method") or ("noaux_tc" if arch == "DeepseekV3ForCausalLM"
                                         else "greedy"))
    if moe.topk_method not in TOPK_METHODS or (arch == "DeepseekV2ForCausalLM") == (
            moe.topk_method == "noaux_tc"):
        raise ValueError(f"{arch} with topk_method {moe.topk_method!r} is not supported "
                         f"(V2: greedy, group_limited_greedy; V3: noaux_tc)")
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    scale = qk ** -0.5
    if scaling and scaling.get("mscale_all_dim"):  # YaRN: the softmax scale grows too
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=1, head_dim=qk,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False), hidden_act=cfg.get("hidden_act", "silu"),
        attention_scale=scale, kv_latent_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        family={"mla": mla, "moe": moe}, torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=as_list(cfg.get("eos_token_id")))
