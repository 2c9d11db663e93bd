"""Verification of drafted tokens (speculative decoding), exact: the tokens that come out are
distributed as the target model alone would sample them.

A sequence with k drafts has k + 1 rows of target logits: row i scores the token after draft
i - 1 (row 0: after the last verified token). Greedy rows accept the longest prefix of drafts
equal to the target's argmax, then add the target's own token. Sampled rows accept draft x with
probability min(1, p(x) / q(x)) and, at the first rejection, draw from the normalized residual
max(0, p - q) (Leviathan et al. 2023); when every draft is accepted, a bonus token is drawn
from the last row. q is the draft model's distribution, or a point mass on x for proposers that
draft deterministically (n-gram, suffix): x is then accepted with probability p(x) and the
residual is p without x. p is exactly the distribution the sampler would sample from at that
position (the SamplingMetadata rows carry each position's bans and penalties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata, top_logprobs


@dataclass
class Span:
    """One sequence's rows: [first, first + len(drafts)] of the logits."""

    first: int
    drafts: list[int]
    draft_probs: torch.Tensor | None = None  # (drafts, vocab), None: a point mass per draft


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per span: accepted drafts + one token of the target's
    logprobs: list[list]  # per span, per token: dict[token id, Logprob] or None
    num_accepted: list[int]  # per span: drafts accepted


def verify(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata,
           spans: list[Span]) -> VerifyOutput:
    """logits: (rows, vocab) float32 with one SamplingMetadata entry per row."""
    raw = sampler.raw_logprobs(logits, meta)
    logits = sampler.processed(logits, meta)
    argmax = sampler.ops.argmax(logits).tolist()
    sampled = [s for s in spans if meta.temperatures[s.first] != 0]
    accepted = {id(s): _greedy_accepted(s, argmax) for s in spans
                if meta.temperatures[s.first] == 0}
    final = {}
    if sampled:
        probs = sampler.probs(logits, meta)
        accepted.update(_sampled_accepted(sampler, probs, meta, sampled))
        final = _final_tokens(sampler, probs, meta, sampled, accepted)
    out = VerifyOutput([], [], [])
    for s in spans:
        a = accepted[id(s)]
        tokens = s.drafts[:a] + [final.get(id(s), argmax[s.first + a])]
        k = meta.logprobs[s.first] if meta.logprobs else None
        out.token_ids.append(tokens)
        out.logprobs.append([None if k is None else top_logprobs(raw[s.first + i], k, t)
                             for i, t in enumerate(tokens)])
        out.num_accepted.append(a)
    return out


def _greedy_accepted(span: Span, argmax: list[int]) -> int:
    a = 0
    while a < len(span.drafts) and span.drafts[a] == argmax[span.first + a]:
        a += 1
    return a


def _sampled_accepted(sampler: Sampler, probs: torch.Tensor, meta: SamplingMetadata,
                      spans: list[Span]) -> dict[int, int]:
    """Drafts accepted per span: the first draft whose uniform u has u * q(x) >= p(x) ends it."""
    with_drafts = [s for s in spans if s.drafts]
    if not with_drafts:
        return {id(s): 0 for s in spans}
    dev = probs.device
    rows = torch.tensor([s.first + i for s in with_drafts for i in range(len(s.drafts))],
                        device=dev)
    tokens = torch.tensor([t for s in with_drafts for t in s.drafts], device=dev)
    p = probs[rows, tokens]
    q = torch.cat([torch.ones(len(s.drafts), device=dev) if s.draft_probs is None else
                   s.draft_probs[torch.arange(len(s.drafts)), s.drafts[:]].to(dev)
                   for s in with_drafts])
    u = sampler.uniforms([meta.generators[s.first] for s in with_drafts for _ in s.drafts], dev)
    ok = (u * q < p).tolist()
    result, at = {id(s): 0 for s in spans}, 0
    for s in with_drafts:
        row = ok[at: at + len(s.drafts)]
        result[id(s)] = row.index(False) if False in row else len(row)
        at += len(s.drafts)
    return result


def _final_tokens(sampler: Sampler, probs: torch.Tensor, meta: SamplingMetadata,
                  spans: list[Span], accepted: dict[int, int]) -> dict[int, int]:
    """The token after the accepted drafts: from the residual at a rejection, else the bonus."""
    weights = []
    for s in spans:
        a = accepted[id(s)]
        row = probs[s.first + a]
        if a < len(s.drafts):
            if s.draft_probs is None:
                residual = row.clone()
                residual[s.drafts[a]] = 0.0
            else:
                residual = (row - s.draft_probs[a].to(row.device)).clamp_(min=0.0)
            row = residual if float(residual.sum()) > 0 else row
        weights.append(row)
    tokens = sampler.draw(torch.stack(weights), [meta.generators[s.first] for s in spans])
    return {id(s): t for s, t in zip(spans, tokens.tolist())}
