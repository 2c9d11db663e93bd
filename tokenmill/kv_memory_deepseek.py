"""What DeepSeek V3.2 and V4 attention cache per layer and token, read from config.json alone
(V2/V3's plain MLA latent is kv_memory.py's Shape.latent_dim, which the engine runs).

    model  layer type                    per layer, per sequence
    V3.2   indexed_attention             one MLA latent (kv_lora_rank + qk_rope_head_dim) and
                                         one lightning-indexer key (index_head_dim) a token
    V4     sliding_attention             the last sliding_window tokens' shared K=V (head_dim)
           compressed_sparse_attention   the window + one K=V entry and one indexer key per
                                         4 tokens + the compressors' pending state
           heavily_compressed_attention  the window + one K=V entry per 128 tokens + state

Bytes come in two kinds: an engine KV dtype stores all of a layer's vectors in that format,
laid out as tokenmill's engine does (latent_bytes_per_token for MLA; for V4 the pools of
models/deepseek_v4.py cache_pools: the window is the raw pool's, which also keeps the
compressors' projected inputs of its tokens as their pending state); DEEPSEEK stores them the
way DeepSeek deploys them (a sliding_window of K=V, fp32 compressor buffers), which is what
its published cache sizes count. The report is in kv_memory_deepseek_report.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenmill.layers.kv_cache import latent_bytes_per_token

DEEPSEEK = "deepseek"
CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
V4_LAYER_TYPES = (SLIDING, CSA, HCA)
V4_RATES = {CSA: 4, HCA: 128}  # transformers' DeepseekV4Config defaults


def scaled_bytes(values: int, bits: int, group: int, scale_bytes: int) -> int:
    """`values` quantized to `bits` each, with one scale of `scale_bytes` per `group` values."""
    return values * bits // 8 + -(-values // group) * scale_bytes


@dataclass(frozen=True)
class Part:
    """One vector a layer caches: `width` values per entry, one entry per `ratio` tokens, at
    most `cap` entries (a window of raw tokens; `engine_cap` in tokenmill's layout);
    `deepseek` is an entry's bytes as DeepSeek stores it (0: DeepSeek keeps no such vector)."""

    name: str
    width: int
    deepseek: int
    ratio: int = 1
    cap: int | None = None
    engine_cap: int | None = None

    def entries(self, context: int, block_size: int = 1, kv_dtype: str = DEEPSEEK) -> int:
        cap = self.cap if kv_dtype == DEEPSEEK or self.engine_cap is None else self.engine_cap
        if cap is not None:
            return min(context, cap)
        if self.ratio == 1:  # every token, in the engine's whole blocks
            return -(-context // block_size) * block_size
        return context // self.ratio

    def entry_bytes(self, kv_dtype: str) -> int:
        return self.deepseek if kv_dtype == DEEPSEEK else latent_bytes_per_token(
            1, self.width, kv_dtype)

    def describe(self) -> str:
        cap = self.engine_cap or self.cap
        every = (f"x the last {cap} tokens" if cap else "per token" if self.ratio == 1
                 else f"per {self.ratio} tokens")
        return f"{self.name} {self.width} {every}"


@dataclass(frozen=True)
class LayerType:
    name: str
    layers: int
    parts: tuple[Part, ...]
    state_bytes: int = 0  # per sequence: DeepSeek's fp32 compressor state (DEEPSEEK only)

    def nbytes(self, context: int, kv_dtype: str, block_size: int = 1) -> int:
        """One layer's cache for one sequence of `context` tokens."""
        state = self.state_bytes if kv_dtype == DEEPSEEK else 0
        return state + sum(p.entries(context, block_size, kv_dtype) * p.entry_bytes(kv_dtype)
                           for p in self.parts if kv_dtype != DEEPSEEK or p.deepseek)

    def bytes_per_token(self, context: int, kv_dtype: str) -> float:
        """Per layer, averaged over the context: the window and the state are per sequence."""
        return self.nbytes(context, kv_dtype) / context


@dataclass(frozen=True)
class DeepseekCache:
    name: str
    family: str
    layer_types: tuple[LayerType, ...]
    max_len: int
    native: str  # what the DEEPSEEK row stores

    @property
    def num_layers(self) -> int:
        return sum(t.layers for t in self.layer_types)

    def nbytes(self, context: int, kv_dtype: str, block_size: int = 1) -> int:
        """All layers' cache for one sequence; block_size rounds the per-token parts up to the
        engine's blocks."""
        return sum(t.layers * t.nbytes(context, kv_dtype, block_size) for t in self.layer_types)

    def bytes_per_token(self, context: int, kv_dtype: str) -> float:
        return self.nbytes(context, kv_dtype) / context


def need(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ValueError(f"config.json has no {key!r}, which sizing the DeepSeek KV cache needs")
    return cfg[key]


def v32_cache(name: str, cfg: dict) -> DeepseekCache:
    """DeepSeek deploys V3.2 with the latent in fp8 (an fp32 scale per 128 values) beside a
    bfloat16 RoPE part, and the indexer keys in fp8 with an fp32 scale (inference/model.py of
    DeepSeek-V3.2-Exp: k_cache float8_e4m3fn, k_scale_cache float32 per 128)."""
    rank, rope = need(cfg, "kv_lora_rank"), need(cfg, "qk_rope_head_dim")
    idx = need(cfg, "index_head_dim")
    latent = Part("latent", rank + rope, scaled_bytes(rank, 8, 128, 4) + 2 * rope)
    key = Part("indexer key", idx, scaled_bytes(idx, 8, 128, 4))
    layer_type = LayerType("indexed_attention", need(cfg, "num_hidden_layers"), (latent, key))
    return DeepseekCache(name, "DeepSeek V3.2 (MLA + DSA indexer)", (layer_type,),
                         cfg.get("max_position_embeddings", 0),
                         "latent and indexer keys in fp8 with fp32 scales, RoPE part bfloat16")


def v4_rates(cfg: dict) -> dict[str, int]:
    rates = {**V4_RATES, **(cfg.get("compress_rates") or {})}
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        rates[layer_type] = cfg.get(key) or rates[layer_type]  # older configs' spelling
    return rates


def v4_layer_types(cfg: dict) -> list[str]:
    """Per layer, from layer_types (transformers), compress_ratios (DeepSeek's config: 0 is a
    sliding-window layer) or else transformers' default (2 HCA, then CSA/HCA interleaved)."""
    n, rates = need(cfg, "num_hidden_layers"), v4_rates(cfg)
    if cfg.get("layer_types") is not None:
        key, types = "layer_types", list(cfg["layer_types"])
    elif cfg.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        key, types = "compress_ratios", []
        for i, ratio in enumerate(cfg["compress_ratios"][:n]):
            if ratio not in by_ratio:
                raise ValueError(f"config.json compress_ratios[{i}] = {ratio!r}: DeepSeek V4 "
                                 f"layers compress by one of {sorted(by_ratio)}")
            types.append(by_ratio[ratio])
    else:
        key = "layer_types"
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    for i, t in enumerate(types[:n]):
        if t not in V4_LAYER_TYPES:
            raise ValueError(f"config.json layer_types[{i}] = {t!r}: DeepSeek V4 layer types "
                             f"are {', '.join(V4_LAYER_TYPES)}")
    if len(types) < n:  # compress_ratios also lists the MTP layers, after the model's
        raise ValueError(f"config.json {key} has {len(types)} entries for {n} layers")
    return types[:n]


def compressor_state(ratio: int, width: int, overlap: bool) -> int:
    """kv_state and score_state, fp32 (ratio, width) each, doubled in both by CSA's
    overlapping windows (DeepSeek's Compressor)."""
    factor = 2 if overlap else 1
    return 2 * (factor * ratio) * (factor * width) * 4


def v4_cache(name: str, cfg: dict) -> DeepseekCache:
    """DeepSeek stores a K=V entry's non-RoPE values in fp8 with a one-byte (ue8m0) scale per
    64 and its RoPE part in bfloat16, and indexer keys in fp4 with a one-byte scale per 32
    (inference/model.py of DeepSeek-V4: act_quant(kv[..., :-rd], 64), fp4_act_quant(kv, 32))."""
    types, rates = v4_layer_types(cfg), v4_rates(cfg)
    dim, idx = need(cfg, "head_dim"), need(cfg, "index_head_dim")
    rope = cfg.get("qk_rope_head_dim") or int(dim * (cfg.get("partial_rotary_factor") or 0.125))
    entry = scaled_bytes(dim - rope, 8, 64, 1) + 2 * rope
    sliding = need(cfg, "sliding_window")
    raw = max([sliding] + [2 * rates[CSA]] * (CSA in types) + [rates[HCA]] * (HCA in types))
    window = Part("window K=V", dim, entry, cap=sliding, engine_cap=raw)
    layer_types = []
    for t in V4_LAYER_TYPES:
        if t not in types:
            continue
        parts, state = (window,), 0
        if t != SLIDING:  # tokenmill keeps the compressor's projected values and gates
            inputs = 2 * (2 * dim if t == CSA else dim) + (4 * idx if t == CSA else 0)
            parts += (Part("compressed K=V", dim, entry, ratio=rates[t]),
                      Part("compressor inputs", inputs, 0, cap=raw))
            state = compressor_state(rates[t], dim, t == CSA)
        if t == CSA:
            parts += (Part("indexer key", idx, scaled_bytes(idx, 4, 32, 1), ratio=rates[t]),)
            state += compressor_state(rates[t], idx, True)
        layer_types.append(LayerType(t, types.count(t), parts, state))
    return DeepseekCache(name, "DeepSeek V4 (sliding window + CSA/HCA)", tuple(layer_types),
                         cfg.get("max_position_embeddings", 0),
                         "K=V in fp8 with RoPE part bfloat16, indexer keys fp4")


def cache_from_config(name: str, cfg: dict) -> DeepseekCache | None:
    """None when the config is neither V4 nor MLA with an indexer (V3.2)."""
    if cfg.get("model_type") == "deepseek_v4" or "compress_ratios" in cfg:
        return v4_cache(name, cfg)
    if cfg.get("kv_lora_rank") and cfg.get("index_head_dim"):
        return v32_cache(name, cfg)
    return None


_V4 = {"model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64,
       "sliding_window": 128, "index_head_dim": 128, "max_position_embeddings": 1048576}
# The published config.json values the cache depends on (deepseek-ai/<name> on Hugging Face);
# compress_ratios ends with the MTP layer's 0
KNOWN_CONFIGS = {
    "deepseek-v3.2": {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                      "index_head_dim": 128, "max_position_embeddings": 163840},
    "deepseek-v4-flash": {**_V4, "num_hidden_layers": 43,
                          "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]},
    "deepseek-v4-pro": {**_V4, "num_hidden_layers": 61,
                        "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]},
}


def load_deepseek(model: str) -> DeepseekCache | None:
    """A known name or an HF folder with a V3.2 or V4 config.json; None otherwise."""
    if model in KNOWN_CONFIGS:
        return cache_from_config(model, KNOWN_CONFIGS[model])
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    return cache_from_config(os.path.basename(os.path.normpath(model)), cfg)
