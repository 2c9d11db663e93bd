"""Sequence: the state of one completion, scheduled by its counters (computed vs total tokens)."""

from __future__ import annotations

import enum
import itertools

from tokenmill.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + generated), how many of them have K/V in the cache, and the block table.

    A step computes tokens [num_computed_tokens, num_computed_tokens + k). When that reaches
    num_tokens, the last position's logits sample the next token. Prefill, chunked prefill,
    decode, prefix-cache hits and recompute after preemption are all just values of k.
    Speculative decoding too: drafted tokens (spec_token_ids, not yet verified) extend a decode
    step to 1 + len(drafts) tokens, and only the verified ones join token_ids.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str = "",
        index: int = 0,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        # One block table per KV cache group (models mixing sliding-window and full-attention
        # layers keep the two kinds in separate pools); block_table is group 0's.
        self.block_tables: list[list[int]] = [[]]
        self.stage_tables: list[list[int]] = []  # per pool of a staged KV format (int4)
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.group_size = 1  # sequences this one becomes once its prompt is done (n > 1 forks)
        self.generator = None  # per-sequence torch.Generator when params.seed is set
        self.logprobs: list = []
        self.prompt_logprobs: list = []
        self.spec_token_ids: list[int] = []  # drafted for this step, verified by it
        self.spec_draft_probs = None  # (drafts, vocab) draft-model probabilities, or None
        self.grammar = None  # structured outputs: this sequence's llguidance matcher

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """The prompt is done and the last sampled token is the only one without K/V."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    def runs_as_decode(self, n: int) -> bool:
        """Whether a step computing n of its tokens runs them as decode rows: one generated
        token, or a verify step's last token + drafts (anything else is a prefill chunk). A
        prompt's one-token chunk stays a chunk: the decode and prefill attention kernels sum in
        different orders, so a prompt's numbers would otherwise depend on how it was chunked."""
        return bool(self.spec_token_ids) or (
            n == 1 and self.num_computed_tokens >= self.num_prompt_tokens)

    def step_token_ids(self, first: int, n: int) -> list[int]:
        """The n tokens a step feeds from position first: known tokens, then drafts."""
        ids = self.token_ids[first : first + n]
        return ids + self.spec_token_ids[: n - len(ids)] if len(ids) < n else ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
