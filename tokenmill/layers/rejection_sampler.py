"""Verification of drafted tokens (speculative decoding), exact: the tokens that come out are
distributed as the target model alone would sample them.

A sequence with k drafts has k + 1 rows of target logits: row i scores the token after draft
i - 1 (row 0: after the last verified token). p is exactly the distribution the sampler would
sample from at that position (the SamplingMetadata rows carry each position's bans and
penalties).
- Greedy rows accept the longest prefix of drafts equal to the target's argmax, then add the
  target's own token.
- Drafts from a deterministic proposer (n-gram, suffix: q is a point mass on x): each row
  draws its token t from p with one uniform number, exactly as the sampler would, and the draft
  is accepted while t == x. That is rejection sampling for a point mass (x is kept with
  probability p(x); otherwise t follows p without x, the normalized residual), coupled to the
  plain draw: a seeded request uses one number of its generator per token, so it gives the
  same tokens as without speculation.
- Drafts of a draft model (q its distribution): x is accepted with probability
  min(1, p(x) / q(x)); at the first rejection a token is drawn from the normalized residual
  max(0, p - q) (Leviathan et al. 2023); when every draft is accepted, a bonus token is drawn
  from the last row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata, inverse_cdf, top_logprobs


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
    tokens = {id(s): _greedy_tokens(s, argmax) for s in spans
              if meta.temperatures[s.first] == 0}
    sampled = [s for s in spans if meta.temperatures[s.first] != 0]
    if sampled:
        probs = sampler.probs(logits, meta)
        tokens.update(_coupled_tokens(sampler, probs, meta,
                                      [s for s in sampled if s.draft_probs is None]))
        tokens.update(_rejection_tokens(sampler, probs, meta,
                                        [s for s in sampled if s.draft_probs is not None]))
    out = VerifyOutput([], [], [])
    for s in spans:
        emitted = tokens[id(s)]
        k = meta.logprobs[s.first] if meta.logprobs else None
        out.token_ids.append(emitted)
        out.logprobs.append([None if k is None else top_logprobs(raw[s.first + i], k, t)
                             for i, t in enumerate(emitted)])
        out.num_accepted.append(len(emitted) - 1)
    return out


def _accepted(drafts: list[int], targets: list[int]) -> int:
    """How many drafts equal the target's tokens, from the first."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def _greedy_tokens(span: Span, argmax: list[int]) -> list[int]:
    row = argmax[span.first: span.first + len(span.drafts) + 1]
    return row[: _accepted(span.drafts, row) + 1]


def _coupled_tokens(sampler: Sampler, probs: torch.Tensor, meta: SamplingMetadata,
                    spans: list[Span]) -> dict[int, list[int]]:
    """Point-mass drafts: every row's own draw, kept while it equals the draft. A seeded
    sequence's generator ends up advanced by one number per emitted token."""
    if not spans:
        return {}
    dev = probs.device
    sizes = [len(s.drafts) + 1 for s in spans]
    shared = sum(n for s, n in zip(spans, sizes) if meta.generators[s.first] is None)
    pool = iter(torch.rand(shared, device=dev, generator=sampler.generator).tolist()
                if shared else [])
    u, states = [], []
    for s, n in zip(spans, sizes):
        gen = meta.generators[s.first]
        states.append(None if gen is None else gen.get_state())
        u += [next(pool) for _ in range(n)] if gen is None else [
            float(torch.rand(1, device=dev, generator=gen)[0]) for _ in range(n)]
    rows = torch.tensor([s.first + i for s, n in zip(spans, sizes) for i in range(n)],
                        device=dev)
    drawn = inverse_cdf(probs[rows], torch.tensor(u, device=dev)).tolist()
    result, at = {}, 0
    for s, n, state in zip(spans, sizes, states):
        row = drawn[at: at + n]
        at += n
        emitted = row[: _accepted(s.drafts, row) + 1]
        result[id(s)] = emitted
        if state is not None:  # rewind, then use exactly one number per emitted token
            gen = meta.generators[s.first]
            gen.set_state(state)
            for _ in emitted:
                torch.rand(1, device=dev, generator=gen)
    return result


def _rejection_tokens(sampler: Sampler, probs: torch.Tensor, meta: SamplingMetadata,
                      spans: list[Span]) -> dict[int, list[int]]:
    """Draft-model drafts: accept with min(1, p / q), then the residual or a bonus draw."""
    if not spans:
        return {}
    accepted = _sampled_accepted(sampler, probs, meta, spans)
    final = _final_tokens(sampler, probs, meta, spans, accepted)
    return {id(s): s.drafts[: accepted[id(s)]] + [final[id(s)]] for s in spans}


def _sampled_accepted(sampler: Sampler, probs: torch.Tensor, meta: SamplingMetadata,
                      spans: list[Span]) -> dict[int, int]:
    """Drafts accepted per span: the first draft whose uniform u has u * q(x) >= p(x) ends it."""
    with_drafts = [s for s in spans if s.drafts]
    dev = probs.device
    rows = torch.tensor([s.first + i for s in with_drafts for i in range(len(s.drafts))],
                        device=dev)
    tokens = torch.tensor([t for s in with_drafts for t in s.drafts], device=dev)
    p = probs[rows, tokens]
    q = torch.cat([s.draft_probs[torch.arange(len(s.drafts)), s.drafts].to(dev)
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
            residual = (row - s.draft_probs[a].to(row.device)).clamp_(min=0.0)
            row = residual if float(residual.sum()) > 0 else row
        weights.append(row)
    tokens = sampler.draw(torch.stack(weights), [meta.generators[s.first] for s in spans])
    return {id(s): t for s, t in zip(spans, tokens.tolist())}
