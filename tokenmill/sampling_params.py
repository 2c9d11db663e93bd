"""SamplingParams: how to pick tokens and when to stop, validated at construction (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules.

    temperature=0 means greedy. top_k of 0 or -1 disables top-k. max_tokens=None generates until
    a stop condition or max_model_len. logprobs=N returns the sampled token plus the top N
    (log-probabilities of the raw model distribution, before penalties and temperature).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(
            _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
            f"temperature must be in [0, 100], got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(  # the sampler puts top_k in an int64 tensor
            _is_int(self.top_k) and (0 <= self.top_k < 2**63 or self.top_k == -1),
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        _check(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0,
                   f"{name} must be in [-2, 2], got {value!r}")
        # torch.Generator.manual_seed takes [-2**63, 2**64); beyond, it fails mid-step.
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
               f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be a positive integer or None, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stop),
               f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        self.stop_strings = list(dict.fromkeys(stop))  # each string checked once per token
        ids = list(self.stop_token_ids or [])
        _check(all(_is_int(t) and t >= 0 for t in ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(dict.fromkeys(ids))
        self.stop_token_set = frozenset(self.stop_token_ids)  # O(1) per generated token
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams or a dict, got "
               f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: a distinct but reproducible seed (vLLM: seed+i)."""
        if self.seed is None or index == 0:
            return self
        child = SamplingParams(**{k: getattr(self, k) for k in _INIT_FIELDS})
        child.seed = self.seed + index
        return child


_INIT_FIELDS = [f for f, d in SamplingParams.__dataclass_fields__.items() if d.init]
