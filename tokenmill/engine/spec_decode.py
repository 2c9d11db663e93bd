"""The engine's side of speculative decoding: before each step, drafts for the decoding
sequences (the proposer named by the SpeculativeConfig, as many per sequence as pay for
themselves by spec_decode/adaptive.py's planner, capped by what the sequence may still
generate); after verification, the counts per request and for the whole engine (Prometheus
reads them from LLMEngine.stats())."""

from __future__ import annotations

import time

import torch

from tokenmill.engine.sequence import Sequence
from tokenmill.outputs import RequestMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode import PROPOSERS, SpeculativeConfig
from tokenmill.spec_decode.adaptive import DraftPlanner, StepCost

MAX_MEASURED_ROWS = 64  # beyond, the cost grows linearly: the last measured slope goes on


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 step_cost: StepCost | None = None, **proposer_args) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = PROPOSERS[config.method](config, **proposer_args)
        self.planner = DraftPlanner(config.num_speculative_tokens,
                                    step_cost if config.adaptive else None)
        self.num_drafts = 0  # verify steps with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_counts = [0] * (config.num_speculative_tokens + 1)  # steps by accepted
        self.kinds: dict[int, int] = {}  # seq_id -> the kind of its current drafts

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:  # drafts left by a step that did not schedule the sequence
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        decoding = [s for s in running if s.is_decoding and s.grammar is None]
        prefill = sum(s.num_uncomputed_tokens for s in running if not s.is_decoding)
        base_rows = len(decoding) + prefill
        if not self.planner.worthwhile(base_rows, prefill):
            return
        room = {s.seq_id: min(self.config.num_speculative_tokens, self._room(s))
                for s in decoding}
        seqs = [s for s in decoding if room[s.seq_id] > 0]
        if not seqs:
            return
        if getattr(self.proposer, "cheap", False):  # propose all, then keep what pays
            paying = self.planner.paying_drafts(base_rows, prefill)
            if not paying:  # none would be kept: only explorations (one draft each)
                due = self.planner.idle_step([s.seq_id for s in seqs])
                seqs = [s for s in seqs if s.seq_id in due]
            props = self._proposals(seqs, [min(room[s.seq_id], max(paying, 1)) for s in seqs])
            keep = self.planner.plan({sid: (len(p.tokens), p.kind) for sid, p in props.items()},
                                     base_rows, prefill)
        else:  # a draft model's tokens cost passes: decide first, then draft that many
            keep = self.planner.plan({s.seq_id: (room[s.seq_id], 0) for s in seqs}, base_rows,
                                     prefill)
            seqs = [s for s in seqs if keep[s.seq_id]]
            props = self._proposals(seqs, [keep[s.seq_id] for s in seqs])
        for seq in seqs:
            p = props[seq.seq_id]
            k = min(keep[seq.seq_id], len(p.tokens))
            seq.spec_token_ids = list(p.tokens[:k])
            seq.spec_draft_probs = p.probs[:k] if p.probs is not None and k else None
            self.kinds[seq.seq_id] = p.kind

    def _proposals(self, seqs: list[Sequence], lengths: list[int]) -> dict:
        if not seqs:
            return {}
        return {s.seq_id: p for s, p in zip(seqs, self.proposer.propose(seqs, lengths))}

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still be used: a verify step adds up to drafts + 1 tokens."""
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room

    def record(self, seq: Sequence, metrics: RequestMetrics, drafted: int, accepted: int) -> None:
        metrics.num_draft_tokens += drafted
        metrics.num_accepted_tokens += accepted
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_counts[accepted] += 1
        self.planner.record(self.kinds.pop(seq.seq_id, 0), drafted, accepted)

    def observe_step(self, rows: int, seqs: int, seconds: float) -> None:
        """A whole engine step of decode rows only (`seqs` sequences' own, the rest drafts)
        took `seconds` (the planner's cost)."""
        if self.planner.cost is not None:
            self.planner.cost.observe(rows, seqs, seconds)

    def finished(self, seqs: list[Sequence]) -> None:
        """Requests that ended (finished or aborted): forget their sequences."""
        self.proposer.finished(seqs)
        for seq in seqs:
            self.planner.forget(seq.seq_id)
            self.kinds.pop(seq.seq_id, None)

    def stats(self) -> dict:
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_counts": list(self.accepted_counts)}


@torch.inference_mode()
def measure_step_cost(runner, kv_manager, max_rows: int, context: int = 128) -> StepCost | None:
    """Seconds of a decode step of the target by its number of rows (one sequence at
    `context` tokens verifying rows - 1 drafts), best of three rounds after a warm-up."""
    max_rows = min(max_rows, MAX_MEASURED_ROWS)
    seq = Sequence([1] * context, SamplingParams(max_tokens=1))
    if not kv_manager.can_allocate(seq, context + max_rows):
        return None
    kv_manager.allocate(seq, context + max_rows)
    seq.num_computed_tokens = context - 1  # K/V of the context: whatever the blocks hold

    def seconds(rows: int) -> float:
        seq.spec_token_ids = [1] * (rows - 1)
        start = time.perf_counter()
        runner.run([(seq, rows)], range(rows))
        return time.perf_counter() - start

    try:
        seconds(max_rows)  # warm-up
        return StepCost.measure(seconds, max_rows)
    finally:
        seq.spec_token_ids = []
        kv_manager.free(seq)
