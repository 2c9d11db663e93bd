"""GPT-2: learned position embeddings, pre-LayerNorm blocks, fused QKV, GELU-tanh MLP, tied head.

Module and parameter names mirror Hugging Face's GPT2LMHeadModel. HF stores c_attn/c_proj/c_fc
as Conv1D with (in, out) weights; they are transposed at load into Linear's (out, in).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import AttentionContext, PagedAttention, last_layer_rows
from tokenmill.layers.linear import Linear, embedding
from tokenmill.models.config import ModelConfig, as_list
from tokenmill.models.loading import load_packed

_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        hidden, self.inner = cfg.hidden_size, self.num_heads * self.head_dim  # (a TP rank's)
        self.c_attn = Linear(hidden, [3 * self.inner], bias=True)  # q | k | v: one HF tensor
        self.c_proj = Linear(self.inner, [hidden], bias=True)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, layer_idx)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, keep=None) -> torch.Tensor:
        """keep: the rows whose output is wanted (AttentionContext.rows_to_keep), else all."""
        tokens = x.shape[0]
        q, k, v = self.c_attn(x).split(self.inner, dim=-1)
        shape = (tokens, self.num_heads, self.head_dim)  # (tokens, heads, head_dim)
        out = self.attn(q.view(shape), k.view(shape), v.view(shape), ctx).reshape(tokens, -1)
        return self.c_proj(out if keep is None else out[keep])


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in (*_GELU_TANH, "gelu"):
            raise ValueError(f"GPT-2 activation {cfg.hidden_act!r} is not supported")
        self.approximate = "tanh" if cfg.hidden_act in _GELU_TANH else "none"
        self.c_fc = Linear(cfg.hidden_size, [cfg.intermediate_size], bias=True)
        self.c_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, keep=None) -> torch.Tensor:
        x = (x if keep is None else x[keep]) + self.attn(self.ln_1(x), ctx, keep)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # (tokens, hidden)
        keep = last_layer_rows(ctx, x)  # the last block's rows past attention (llama.py)
        for i, block in enumerate(self.h):
            x = block(x, ctx, keep if i == len(self.h) - 1 else None)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        if max_positions is not None and max_positions > cfg.max_position_embeddings:
            raise ValueError(f"GPT-2 has learned positions up to {cfg.max_position_embeddings}, "
                             f"asked for {max_positions}")
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight  # GPT-2's head is always tied

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        return self.transformer(input_ids, positions, ctx)  # (tokens, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, out_fp32=True)  # (rows, vocab)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed(self, _hf_gpt2_names(weights))


def _hf_gpt2_names(weights) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names -> this module's names, Conv1D weights transposed; the causal-mask
    buffers old checkpoints carry are dropped."""
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original OpenAI checkpoints have no prefix
        if name.endswith(".attn.masked_bias") or (name.endswith(".attn.bias") and tensor.dim() > 1):
            continue
        if name == "lm_head.weight":
            name = "transformer.wte.weight"  # tied: the head is the embedding
        if name.endswith(_CONV1D):
            tensor = tensor.t()
        yield name, tensor


MODELS = {"GPT2LMHeadModel": GPT2LMHeadModel}


def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
    hidden, heads = cfg["n_embd"], cfg["n_head"]
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        num_hidden_layers=cfg["n_layer"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=cfg.get("n_positions", 1024),
        tie_word_embeddings=True,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=as_list(cfg.get("eos_token_id")),
    )
