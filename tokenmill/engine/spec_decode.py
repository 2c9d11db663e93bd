"""The engine's side of speculative decoding: before each step, drafts for the decoding
sequences (the proposer named by the SpeculativeConfig, each sequence's length chosen by
spec_decode/adaptive.py and capped by what it may still generate); after verification, the
counts per request and for the whole engine (Prometheus reads them from LLMEngine.stats())."""

from __future__ import annotations

from tokenmill.engine.sequence import Sequence
from tokenmill.outputs import RequestMetrics
from tokenmill.spec_decode import PROPOSERS, SpeculativeConfig
from tokenmill.spec_decode.adaptive import LengthController


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, **proposer_args) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = PROPOSERS[config.method](config, **proposer_args)
        self.lengths = LengthController(config.num_speculative_tokens, config.adaptive)
        self.num_drafts = 0  # verify steps with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_counts = [0] * (config.num_speculative_tokens + 1)  # steps by accepted

    def propose(self, running: list[Sequence]) -> None:
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        seqs, lengths = [], []
        for seq in running:
            if seq.is_decoding:
                k = min(self.lengths.next_length(seq.seq_id), self._room(seq))
                if k > 0:
                    seqs.append(seq)
                    lengths.append(k)
        if not seqs:
            return
        for seq, k, (drafts, probs) in zip(seqs, lengths, self.proposer.propose(seqs, lengths)):
            seq.spec_token_ids = list(drafts[:k])
            seq.spec_draft_probs = probs[:k] if probs is not None and drafts else None

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
        self.lengths.record(seq.seq_id, drafted, accepted)

    def finished(self, seqs: list[Sequence]) -> None:
        """Requests that ended (finished or aborted): forget their sequences."""
        self.proposer.finished(seqs)
        for seq in seqs:
            self.lengths.forget(seq.seq_id)

    def stats(self) -> dict:
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_counts": list(self.accepted_counts)}
