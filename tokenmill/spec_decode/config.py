"""SpeculativeConfig: vLLM's speculative_config ({"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}, {"model": PATH, "num_speculative_tokens": 4}), validated when built."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """num_speculative_tokens: the most tokens drafted per step (the adaptive length stays at or
    below it). ngram: drafts what followed the longest earlier match (prompt_lookup_min ..
    prompt_lookup_max tokens) of the sequence's last tokens. suffix: the most frequent
    continuation of the longest matching suffix (up to suffix_decoding_max_tree_depth tokens)
    in the request's own tokens and, when suffix_decoding_max_cached_requests > 0, in recent
    requests' outputs. draft_model: `model` (any model tokenmill loads with the same
    vocabulary) drafts greedily, or by sampling when the request samples.
    disable_by_batch_size: no drafts while more sequences than this are running."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    dtype: str = "auto"  # the draft model's
    quantization: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 0
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    adaptive: bool = True  # shrink / pause speculation for sequences whose drafts fail

    def __post_init__(self) -> None:
        method = self.method or ("draft_model" if self.model else None)
        if method is None:
            raise ValueError('speculative_config needs a "method" (ngram, suffix, draft_model) '
                             'or a draft "model"')
        from tokenmill.spec_decode import PROPOSERS  # the one list of methods

        if method not in PROPOSERS:
            raise ValueError(f"speculative_config method must be one of "
                             f"{', '.join(PROPOSERS)}, got {method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if not _int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if method == "draft_model" and not self.model:
            raise ValueError('speculative_config method "draft_model" needs a draft "model"')
        if method != "draft_model" and self.model:
            raise ValueError(f'speculative_config "model" is for a draft model, not {method!r}')
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)  # as vLLM
        if not (_int(lo) and _int(hi) and 1 <= lo <= hi):
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {lo!r} and {hi!r}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        for name in ("suffix_decoding_max_tree_depth", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not _int(value) or value < 1):
                raise ValueError(f"speculative_config {name} must be a positive integer, "
                                 f"got {value!r}")
        cached = self.suffix_decoding_max_cached_requests
        if not _int(cached) or cached < 0:
            raise ValueError("speculative_config suffix_decoding_max_cached_requests must be an "
                             f"integer >= 0, got {cached!r}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {self.suffix_decoding_min_token_prob!r}")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("speculative_config suffix_decoding_max_spec_factor must be > 0, "
                             f"got {self.suffix_decoding_max_spec_factor!r}")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig, a dict with its field names, a JSON object string, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object or dict, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
