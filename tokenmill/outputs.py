"""What generate() returns: RequestOutput / CompletionOutput / RequestMetrics (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated (or prompt) position: token id -> Logprob.
LogprobsList = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Timestamps (time.perf_counter seconds), prefix-cache and speculative-decoding counts of
    one request. token_times has one entry per step that gave the request tokens (a step may
    give several when drafted tokens are accepted); num_output_tokens is the longest
    completion's length."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # drafted tokens verified (speculative decoding)
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def mean_inter_token_latency(self) -> float | None:
        """Time per generated token after the first (of the longest completion: a step that
        gave it k tokens counts k)."""
        tokens = max(self.num_output_tokens, len(self.token_times)) - 1
        if len(self.token_times) < 2 or tokens < 1:
            return None
        return (self.token_times[-1] - self.token_times[0]) / tokens

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the n completions. text/token_ids are cumulative; delta_* hold what is new since
    the previous output of this request (what a stream should print)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: LogprobsList | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
