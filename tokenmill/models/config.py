"""ModelConfig: the hyperparameters every loader (HF, GGUF, llama2.c) normalizes a model into."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer
    sliding_window: int | None = None
    layer_norm_eps: float = 1e-5  # GPT-2
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def sliding_window_for(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def is_sliding(self) -> bool:
        return any(self.sliding_window_for(i) for i in range(self.num_hidden_layers))

    def kv_cache_groups(self) -> list[tuple[list[int], int | None]]:
        """Layers that share a KV block pool, with the window their blocks are freed beyond.
        One group normally; a model mixing sliding-window and full-attention layers gets two
        (full first), so the sliding layers' old blocks can be freed while the full layers
        keep the whole history."""
        windows = [self.sliding_window_for(i) for i in range(self.num_hidden_layers)]
        full = [i for i, w in enumerate(windows) if w is None]
        sliding = [i for i, w in enumerate(windows) if w is not None]
        window = max((windows[i] for i in sliding), default=None)
        if not sliding or not full:
            return [(full or sliding, window)]
        return [(full, None), (sliding, window)]

    def kv_cache_slot(self, layer: int) -> tuple[int, int]:
        """(group, index within the group's cache) of a layer."""
        for group, (layers, _) in enumerate(self.kv_cache_groups()):
            if layer in layers:
                return group, layers.index(layer)
        raise IndexError(layer)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From a Hugging Face config.json (transformers 4 or 5 field names)."""
        from tokenmill.models.registry import architecture_of, model_class

        arch = architecture_of(cfg)
        model_class(arch)  # unsupported architecture: a clear error before reading fields
        try:
            if arch == "GPT2LMHeadModel":
                return _gpt2_from_hf(cfg)
            return cls._llama_from_hf(arch, cfg)
        except KeyError as e:
            raise ValueError(f"config.json of a {arch} lacks the field {e.args[0]!r}") from None

    @classmethod
    def _llama_from_hf(cls, arch: str, cfg: dict) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if rope.get("rope_type", "default") != "default":
            scaling = rope
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=cfg.get("hidden_act", "silu"),
            layer_types=_layer_types(arch, cfg),
            sliding_window=_sliding_window(arch, cfg),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
        )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _sliding_window(arch: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        return None
    return window


def _layer_types(arch: str, cfg: dict) -> list[str] | None:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
        first_sliding = cfg.get("max_window_layers", 0)
        return [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    return None


def _gpt2_from_hf(cfg: dict) -> ModelConfig:
    hidden, heads = cfg["n_embd"], cfg["n_head"]
    return ModelConfig(
        architecture="GPT2LMHeadModel",
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
        eos_token_ids=_as_list(cfg.get("eos_token_id")),
    )
