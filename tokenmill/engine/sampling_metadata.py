"""From the engine's sequences to the sampler's SamplingMetadata: plain per-row values, so the
sampler (a layer) never sees engine objects. A row may score a position `offset` drafted
tokens ahead of a sequence (speculative decoding): its bans and penalties are those the
sequence would have with those drafts accepted."""

from __future__ import annotations

import torch

from tokenmill.engine.sequence import Sequence
from tokenmill.layers.sampler import Penalties, SamplingMetadata


def sampling_metadata(seqs: list[Sequence], eos_ids: list[int], device: torch.device,
                      offsets: list[int] | None = None) -> SamplingMetadata:
    params = [s.params for s in seqs]
    offsets = offsets or [0] * len(seqs)
    return SamplingMetadata(
        temperatures=[0.0 if p.greedy else p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        generators=[_generator(s, device) for s in seqs],
        banned=[_banned(s, eos_ids, o) for s, o in zip(seqs, offsets)],
        penalties=[_penalties(s, o) for s, o in zip(seqs, offsets)],
        logprobs=[p.logprobs for p in params],
    )


def _banned(seq: Sequence, eos_ids: list[int], offset: int = 0) -> list[int]:
    """Tokens that would stop the sequence before min_tokens (vLLM: eos, unless ignore_eos,
    and stop_token_ids)."""
    p = seq.params
    if seq.num_output_tokens + offset >= p.min_tokens:
        return []
    return [*(() if p.ignore_eos else eos_ids), *p.stop_token_ids]


def _generator(seq: Sequence, device: torch.device) -> torch.Generator | None:
    """A seeded sequence's own generator (created at its first draw), else None (shared)."""
    if seq.params.seed is None:
        return None
    if seq.generator is None:
        seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    return seq.generator


def _penalties(seq: Sequence, offset: int = 0) -> Penalties | None:
    p = seq.params
    if not p.has_penalties:
        return None
    drafts = seq.spec_token_ids[:offset]
    return Penalties(p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                     seq.token_ids + drafts, seq.output_token_ids + drafts)
