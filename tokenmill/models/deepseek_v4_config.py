"""DeepSeek V4's hyperparameters from its config.json (transformers' DeepseekV4Config names,
and the legacy ones DeepSeek's own configs ship: compress_ratios, num_hash_layers,
qk_rope_head_dim, rope_scaling)."""

from __future__ import annotations

import dataclasses

from tokenmill.models.config import ModelConfig, as_list
from tokenmill.models.deepseek_v4_attention import CSA, HCA, SLIDING

LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # DeepSeek's compress_ratios per layer


@dataclasses.dataclass(frozen=True)
class V4:
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict
    q_lora_rank: int
    rope_dim: int
    rope_main: tuple[float, dict | None]  # (theta, scaling) of the sliding-only layers
    rope_compress: tuple[float, dict | None]  # of the compressed layers and their compressors
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float


def _layer_types(cfg: dict, n: int) -> list[str]:
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
    elif cfg.get("compress_ratios"):
        unknown = [r for r in cfg["compress_ratios"] if r not in RATIO_TYPES]
        if unknown:
            raise ValueError(f"config.json compress_ratios: unknown ratio {unknown[0]!r} "
                             f"(known: {', '.join(map(str, RATIO_TYPES))})")
        types = [RATIO_TYPES[r] for r in cfg["compress_ratios"]]
    else:  # transformers' default: two HCA layers, then CSA and HCA in turn
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"config.json layer_types: unknown layer type {bad[0]!r} "
                         f"(known: {', '.join(LAYER_TYPES)})")
    if len(types) < n:
        raise ValueError(f"config.json layer_types has {len(types)} entries for {n} layers")
    return types[:n]


def _mlp_types(cfg: dict, n: int) -> list[str]:
    types = cfg.get("mlp_layer_types")
    if not types:
        hashed = cfg.get("num_hash_layers", 3)
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    bad = [t for t in types if t not in MLP_TYPES]
    if bad:
        raise ValueError(f"config.json mlp_layer_types: unknown type {bad[0]!r} "
                         f"(known: {', '.join(MLP_TYPES)})")
    return list(types)[:n]


def _ropes(cfg: dict) -> tuple[tuple, tuple]:
    """(theta, scaling) of the main and the compress RoPE. YaRN is applied only to the
    compressed layers, with cos/sin unscaled (attention_factor 1), as transformers does."""
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope.get("main"), dict):
        main, compress = rope["main"], rope["compress"]
    else:
        scaling = {k: v for k, v in (rope or cfg.get("rope_scaling") or {}).items()}
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}

    def pair(p: dict) -> tuple:
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "default":
            return float(p["rope_theta"]), None
        scaling = {k: v for k, v in p.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if kind == "yarn":
            scaling.setdefault("attention_factor", 1.0)
        return float(p["rope_theta"]), scaling

    return pair(main), pair(compress)


def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
    n, head_dim = cfg["num_hidden_layers"], cfg.get("head_dim", 512)
    rope_dim = cfg.get("qk_rope_head_dim") or int(head_dim * cfg.get(
        "partial_rotary_factor", 64 / 512))
    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        rates[kind] = cfg.get(key, rates[kind])
    main, compress = _ropes(cfg)
    v4 = V4(tuple(_layer_types(cfg, n)), tuple(_mlp_types(cfg, n)), rates,
            cfg.get("q_lora_rank", 1024), rope_dim, main, compress,
            cfg.get("sliding_window", 128), cfg.get("o_groups", 8), cfg.get("o_lora_rank", 1024),
            cfg.get("index_n_heads", 64), cfg.get("index_head_dim", 128),
            cfg.get("index_topk", 512), cfg.get("hc_mult", 4), cfg.get("hc_sinkhorn_iters", 20),
            cfg.get("hc_eps", 1e-6), cfg["n_routed_experts"], cfg["num_experts_per_tok"],
            cfg.get("scoring_func", "sqrtsoftplus"), cfg.get("routed_scaling_factor", 1.5),
            cfg.get("swiglu_limit", 10.0))
    if v4.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ValueError(f"config.json scoring_func {v4.scoring_func!r} is not supported "
                         f"(sqrtsoftplus, sigmoid, softmax)")
    heads = cfg["num_attention_heads"]
    if (heads * head_dim) % v4.o_groups:
        raise ValueError(f"o_groups ({v4.o_groups}) does not divide the heads' "
                         f"{heads} x {head_dim} output values")
    return ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["moe_intermediate_size"], num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 1048576),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=main[0],
        sliding_window=v4.sliding_window, hidden_act=cfg.get("hidden_act", "silu"),
        family={"v4": v4}, torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=as_list(cfg.get("eos_token_id")))
