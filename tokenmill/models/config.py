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
    rotary_dim: int | None = None  # RoPE on each head's first rotary_dim dims; None = all
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer
    sliding_window: int | None = None
    layer_norm_eps: float = 1e-5  # GPT-2
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    chat_template: str | None = None  # the family's template, for files that ship none
    # MLA (DeepSeek V2/V3): the cache holds one latent of this many values per token per
    # layer instead of K and V heads (num_key_value_heads and head_dim then describe it: 1, dim)
    kv_latent_dim: int | None = None
    family: dict = field(default_factory=dict)  # a family's own hyperparameters (its file's)
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
        """From a Hugging Face config.json (transformers 4 or 5 field names), by the family
        module of its architecture (models/registry.py)."""
        from tokenmill.models.registry import architecture_of, family

        arch = architecture_of(cfg)
        module = family(arch)  # unsupported architecture: a clear error before reading fields
        try:
            return module.config_from_hf(arch, cfg)
        except KeyError as e:
            raise ValueError(f"config.json of a {arch} lacks the field {e.args[0]!r}") from None


def as_list(value) -> list[int]:
    """An eos_token_id field (an id, a list of ids or None) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
