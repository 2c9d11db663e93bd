"""Sampler: turns one row of logits per sequence into the next token, batched.

Order (as in vLLM): min_tokens masking, penalties, then greedy argmax or temperature -> min-p ->
top-k -> top-p -> random draw. The draw is inverse-CDF sampling: one uniform number per row
(an exponential race over the vocabulary cost ~25 ms per 16 rows of 49K tokens on CPU), from a
per-sequence torch.Generator for seeded requests, so a seeded sequence draws the same tokens
whatever else shares its batch. The sampler sees only SamplingMetadata (plain values per row,
built by the engine), never the engine's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers import ops
from tokenmill.outputs import Logprob


@dataclass
class Penalties:
    """One row's penalties: repetition over `seen` (prompt + output ids), presence and
    frequency over `output` ids (OpenAI semantics)."""

    repetition: float
    presence: float
    frequency: float
    seen: list[int]
    output: list[int]


@dataclass
class GrammarMasks:
    """Row rows[k] may only take the tokens whose bit is set in bitmask[k] (int32 words, bit t
    of the row is token t: llguidance's layout); tokens beyond the bitmask are not allowed."""

    rows: list[int]
    bitmask: torch.Tensor  # (len(rows), ceil(vocab / 32)) int32

    def forbidden(self, vocab: int) -> torch.Tensor:
        """(len(rows), vocab) bool: True where the token is not allowed. One table lookup
        per byte (the words are little-endian, so byte k holds tokens 8k .. 8k+7)."""
        table = _FORBIDDEN.to(self.bitmask.device)
        unpacked = table[self.bitmask.view(torch.uint8).long()].view(len(self.rows), -1)
        if unpacked.shape[1] >= vocab:
            return unpacked[:, :vocab]
        out = torch.ones(len(self.rows), vocab, dtype=torch.bool)
        out[:, :unpacked.shape[1]] = unpacked
        return out


_FORBIDDEN = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0  # (byte, bit)


@dataclass
class SamplingMetadata:
    """Per row of logits: how to sample it. temperature 0 = greedy."""

    temperatures: list[float]
    top_k: list[int]  # 0 = all
    top_p: list[float]
    min_p: list[float]
    generators: list[torch.Generator | None]  # a seeded request's own; None: the shared one
    banned: list[list[int]] = field(default_factory=list)  # per row, masked (min_tokens)
    penalties: list[Penalties | None] = field(default_factory=list)
    logprobs: list[int | None] = field(default_factory=list)  # top-k logprobs wanted, or None
    grammar: GrammarMasks | None = None  # structured outputs: the tokens some rows may take

    def __len__(self) -> int:
        return len(self.temperatures)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


def apply_banned(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """logits[i, t] = -inf for every token t banned in row i (one indexing op for all rows)."""
    rows = [i for i, tokens in enumerate(banned) for t in tokens if t < logits.shape[1]]
    cols = [t for tokens in banned for t in tokens if t < logits.shape[1]]
    if rows:
        logits[torch.tensor(rows, device=logits.device),
               torch.tensor(cols, device=logits.device)] = -float("inf")


def apply_grammar(logits: torch.Tensor, raw: torch.Tensor, grammar: GrammarMasks) -> None:
    """Mask what each constrained row's grammar forbids, in place. Where the grammar allows
    only tokens min_tokens bans (the grammar is complete: only EOS is left), the grammar wins:
    the row is the raw logits, masked."""
    index = torch.tensor(grammar.rows, device=logits.device)
    forbidden = grammar.forbidden(logits.shape[1]).to(logits.device)
    masked = logits[index].masked_fill_(forbidden, -float("inf"))
    dead = masked.amax(-1) == -float("inf")
    if bool(dead.any()):
        masked[dead] = raw[index[dead]].masked_fill(forbidden[dead], -float("inf"))
        # A matcher in an error state allows nothing: leave the row as it was (the engine
        # stops the sequence when its token does not match).
        still = torch.isinf(masked).all(-1)
        masked[still] = logits[index[still]]
    logits[index] = masked


def apply_penalties(logits: torch.Tensor, penalties: list[Penalties | None]) -> None:
    """Repetition penalty over prompt + output tokens (HF/vLLM); presence and frequency
    penalties over output tokens (OpenAI semantics). In place."""
    vocab = logits.shape[1]
    for i, p in enumerate(penalties):
        if p is None:
            continue
        row = logits[i]
        if p.repetition != 1.0:
            seen = torch.tensor(sorted(set(p.seen)), device=row.device, dtype=torch.long)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition, vals * p.repetition)
        if p.presence or p.frequency:
            out = torch.tensor(p.output, device=row.device, dtype=torch.long)
            counts = torch.zeros(vocab, device=row.device).index_add_(
                0, out, torch.ones_like(out, dtype=torch.float)
            )
            row -= p.frequency * counts + p.presence * (counts > 0).float()


CANDIDATES = 1024  # tokens sorted for top-p when they hold enough of the mass


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside min-p, top-k and top-p, row-wise. top_k=0 means all."""
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(~keep, -float("inf"))
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    # Only the best `width` tokens can survive; a full sort of a 49k vocabulary costs ~3.5 ms
    # a row on CPU, topk of the candidates ~0.1 ms. Without top-k, top-p alone needs every
    # token only when the best CANDIDATES do not already hold top_p of the mass.
    width = int(k.max())
    full_lse = logits.logsumexp(-1)
    if width > CANDIDATES and use_p:
        mass = (logits.topk(CANDIDATES).values - full_lse[:, None]).exp().sum(-1)
        if bool((mass >= top_p).all()):
            width = CANDIDATES
    sorted_logits, order = logits.topk(width, sorted=True)
    if use_k:
        kth = sorted_logits.gather(1, (k.clamp(max=width) - 1)[:, None])  # k-th largest logit
        tied = int((logits >= kth).sum(-1).max())  # top-k keeps every tie of the k-th (HF,
        if tied > width:  # vLLM), also past the candidates: whatever the other rows' k
            sorted_logits, order = logits.topk(tied, sorted=True)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    if use_p:  # probabilities among the tokens top-k kept (all of them without top-k)
        lse = torch.where(top_k > 0, sorted_logits.logsumexp(-1), full_lse)
        probs = (sorted_logits - lse[:, None]).exp()
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        cut = (before >= top_p[:, None]) & (top_p[:, None] < 1)  # 1 = off (not a rounding)
        sorted_logits = sorted_logits.masked_fill(cut, -float("inf"))
    return torch.full_like(logits, -float("inf")).scatter(1, order, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, backend=None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.ops = backend or ops.current()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: (rows, vocab) float32, one row per sequence to sample
        raw_logprobs = self.raw_logprobs(logits, meta)
        logits = self.processed(logits, meta)
        greedy = [t == 0 for t in meta.temperatures]
        if all(greedy):
            tokens = self.ops.argmax(logits)
        else:
            tokens = self.sample(logits, meta)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=logits.device),
                                     self.ops.argmax(logits), tokens)
        token_ids = tokens.tolist()
        logprobs = [None if k is None else top_logprobs(raw_logprobs[i], k, token_ids[i])
                    for i, k in enumerate(meta.logprobs or [None] * len(meta))]
        return SamplerOutput(token_ids, logprobs)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row drawn from its filtered distribution (probs), with one uniform
        number per row: the kernels' sampler where there is one (csrc/sample.cpp: the same
        draw without the ~20 tensor ops over the vocabulary), else inverse_cdf(probs)."""
        u = self.uniforms(meta.generators, logits.device)
        drawn = self.ops.sample(logits, meta.temperatures, meta.top_k, meta.top_p, meta.min_p, u)
        if drawn is not None and (int(drawn.min()) >= 0 or not any(
                t > 0 and d < 0 for t, d in zip(meta.temperatures, drawn.tolist()))):
            return drawn
        return inverse_cdf(self.probs(logits, meta), u)  # also rows with a NaN / all -inf

    # ---- the pieces, shared with verification of drafted tokens (rejection_sampler.py) -------
    @staticmethod
    def raw_logprobs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
        """The model's own log-probabilities, when some row asks for logprobs."""
        return logits.log_softmax(-1) if any(k is not None for k in meta.logprobs) else None

    @staticmethod
    def processed(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """min_tokens bans, penalties and grammar masks applied (a copy; the caller's logits
        stay)."""
        raw = logits
        if any(meta.banned) or any(p is not None for p in meta.penalties) \
                or meta.grammar is not None:
            logits = logits.clone()
            apply_banned(logits, meta.banned)
            apply_penalties(logits, meta.penalties)
        if meta.grammar is not None:
            apply_grammar(logits, raw, meta.grammar)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """(rows, vocab) the distribution each row samples from: temperature (greedy rows at
        1), min-p, top-k, top-p; filtered tokens have probability 0."""
        dev = logits.device
        temps = torch.tensor([t if t > 0 else 1.0 for t in meta.temperatures], device=dev)
        top_k = torch.tensor([max(k, 0) for k in meta.top_k], device=dev)
        top_p = torch.tensor(meta.top_p, device=dev)
        min_p = torch.tensor(meta.min_p, device=dev)
        return filter_logits(logits / temps[:, None], top_k, top_p, min_p).softmax(-1)

    def uniforms(self, generators: list[torch.Generator | None], device) -> torch.Tensor:
        """One uniform number in [0, 1) per entry: from the entry's own generator (seeded
        requests), else from the sampler's, drawn together."""
        if all(g is None for g in generators):  # the numbers `shared` would get below
            return torch.rand(len(generators), device=device, generator=self.generator)
        u = torch.empty(len(generators), device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            u[shared] = torch.rand(len(shared), device=device, generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                u[i] = torch.rand(1, device=device, generator=gen)[0]
        return u

    def draw(self, weights: torch.Tensor, generators: list) -> torch.Tensor:
        """One token per row of non-negative weights (probabilities, or a residual that is
        not normalized), with one uniform number per row."""
        return inverse_cdf(weights, self.uniforms(generators, weights.device))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative weight exceeds u * total. u is kept below the
    total so that a zero-weight tail (masked tokens) can never be picked."""
    cdf = weights.cumsum(-1)  # (rows, vocab)
    total = cdf[:, -1:]
    u = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0]


def top_logprobs(row: torch.Tensor, num: int, token_id: int) -> dict[int, Logprob]:
    """The chosen token's log-probability and rank, plus the num most likely tokens."""
    chosen = row[token_id]
    result = {token_id: Logprob(float(chosen), int((row > chosen).sum()) + 1)}
    if num:
        values, ids = row.topk(num)
        for rank, (tid, value) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            result.setdefault(tid, Logprob(value, rank))
    return result
