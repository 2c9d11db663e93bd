"""How many drafted tokens each sequence verifies next step: as many as pay for themselves.

Every draft adds a row to the target's step. While a step is memory-bound an extra row is
nearly free; once it is compute-bound (a large batch on a CPU) a row costs about as much as a
token, so only drafts that are likely to be accepted are worth it. The planner therefore
weighs each draft's chance of being accepted against the step's measured cost:

- StepCost: seconds of a decode step by its number of rows: the model's forward pass
  measured at start (piecewise linear between the measured row counts), calibrated by the
  steps the engine really runs (their scheduling, sampling and detokenizing included);
- per kind of proposal (the n-gram and suffix proposers: the matched length, a strong signal:
  a 6-token match's continuation is right far more often than a 1-token match's), the chance
  that a draft is accepted given the ones before it were, alpha (accepted / (accepted +
  rejections), counts that decay, smoothed toward the engine's running rate so a new kind
  starts from what the workload has shown); draft i is accepted with probability alpha^i;
- drafts are taken best first while they raise the step's expected tokens per second, by a
  margin: (tokens + alpha^i / 1.1) / cost(rows + 1) > tokens / cost(rows); when not even a
  certain draft would (a large batch), nothing is proposed (proposing has its own small cost).
  A step that also computes prompt rows is judged by its decode rows' tokens per second: the
  draft's gain per second of the row it adds against that rate.
A sequence whose drafts fail thus drafts less and less, down to none, and the engine never
pays much for speculation that does not work; the same rule keeps drafts short in big batches.
A sequence that has had proposals but no draft for EXPLORE steps verifies one draft anyway, so
its estimate can recover when its text turns repetitive.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DECAY = 0.98  # per verify step of a kind: recent acceptance counts more
TOTAL_DECAY = 0.99  # per verify step of any sequence, for the engine's running rate
EXPLORE = 32
MARGIN = 1.1  # a draft's expected tokens must beat what its row costs by 10%
OBSERVED_STEPS = 256
LINEAR_FROM = 8  # rows: the start-up measurement is fit by a line from here on
RIDGE = 1.0  # per step: the cost fit's pull of per_seq and per_draft toward 0 (see observe)
PRIOR = 2.0  # pseudo-counts pulling a sequence's alpha toward the engine's rate


class StepCost:
    """Seconds of an engine step with r decode rows, of which `seqs` are sequences' own rows
    and the rest drafts. The forward pass of one sequence with r rows is measured at start
    (every row count once per round, up and down in turn, the best of the rounds, so a slow
    spell hits all counts alike; made non-decreasing from the right: a slow outlier is lowered
    to what more rows took, rather than raising every larger count; from LINEAR_FROM rows on,
    where the forward is compute-bound, replaced by the line through those counts). The
    engine's real steps then calibrate it: what they take beyond forward(r) is fit as
    overhead + per_seq x (seqs - 1) + per_draft x drafts over the recent steps, by least
    squares on observations clipped to 3x the prediction (a step that indexed a long prompt is
    not typical), shrunk toward 0 by RIDGE (a count that barely varied in the window, such as
    the drafts of a planner that has all but stopped drafting, cannot take the noise of the
    steps: unshrunk, it put a draft row at several times its cost, and then nothing drafted to
    correct it). per_seq and per_draft may come out below 0 (the start-up measurement's slope
    too steep), down to half that slope. A sequence's row costs more than the measurement's
    (its own history to attend, at real lengths) and a draft row less (it attends its
    sequence's history, read once for all its rows) but more than at the measurement's short
    context; both add sampling work. (A scale on forward(r) fit before came out at several x,
    the measured forward being flat from 1 to 3 rows while real steps are not, and priced
    every longer draft out.)"""

    def __init__(self, rows: list[int], seconds: list[float]) -> None:
        self.rows = list(rows)
        seconds = _straighten(self.rows, [min(seconds[i:]) for i in range(len(seconds))])
        self.seconds = [min(seconds[i:]) for i in range(len(seconds))]
        self.overhead, self.per_seq, self.per_draft = 0.0, 0.0, 0.0
        span = max(self.rows[-1] - self.rows[0], 1)
        self.floor = -0.5 * (self.seconds[-1] - self.seconds[0]) / span  # per_seq, per_draft
        self._forward: dict[int, float] = {}  # forward(r) by r (the ladder never changes)
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=OBSERVED_STEPS)
        self.sums = [0.0] * 9  # n, x1, x2, y, x1x1, x2x2, x1x2, x1y, x2y

    def __call__(self, r: int, seqs: int | None = None) -> float:
        r = max(r, 1)
        seqs = r if seqs is None else min(max(seqs, 1), r)
        forward = self.forward(r)
        return max(forward + self.overhead + self.per_seq * (seqs - 1)
                   + self.per_draft * (r - seqs), 0.1 * forward)

    def forward(self, r: int) -> float:
        seconds = self._forward.get(r)
        if seconds is None:
            seconds = self._forward[r] = self._interpolate(r)
        return seconds

    def _interpolate(self, r: int) -> float:
        rows, secs = self.rows, self.seconds
        if len(rows) == 1:
            return secs[0] * max(r, 1) / rows[0]
        i = min(max(bisect.bisect_left(rows, r), 1), len(rows) - 1)
        r0, r1, s0, s1 = rows[i - 1], rows[i], secs[i - 1], secs[i]
        return max(s0 + (s1 - s0) * (r - r0) / (r1 - r0), secs[0])

    def observe(self, rows: int, seqs: int, seconds: float) -> None:
        """A whole engine step of `rows` decode rows, `seqs` sequences' own, took `seconds`."""
        point = (seqs - 1.0, rows - seqs + 0.0,
                 min(seconds, 3 * self(rows, seqs)) - self.forward(rows))
        if len(self.recent) == self.recent.maxlen:
            self._add(self.recent[0], -1)
        self.recent.append(point)
        self._add(point, 1)
        n, s1, s2, sy, s11, s22, s12, s1y, s2y = self.sums
        v11, v22, v12 = s11 - s1 * s1 / n, s22 - s2 * s2 / n, s12 - s1 * s2 / n
        w1, w2 = s1y - s1 * sy / n, s2y - s2 * sy / n
        a11, a22 = v11 + RIDGE * n, v22 + RIDGE * n  # shrunk toward 0 where counts vary little
        det = a11 * a22 - v12 * v12
        if det > 1e-12 * n * n:
            c, b = (w1 * a22 - w2 * v12) / det, (w2 * a11 - w1 * v12) / det
        else:  # one count never varied (one stream: the sequences'): the other alone
            c = w1 / a11 if a11 > 1e-12 * n else 0.0
            b = w2 / a22 if a22 > 1e-12 * n and c == 0 else 0.0
        c, b = max(c, self.floor), max(b, self.floor)
        self.per_seq, self.per_draft = c, b
        # < 0 where the measured forward was slow (measured in a slow spell at start)
        self.overhead = (sy - c * s1 - b * s2) / n

    def _add(self, point: tuple[float, float, float], sign: int) -> None:
        """Running sums of the recent points, kept per step instead of summing the window again
        (the fit runs after every decode step)."""
        x1, x2, y = point
        for i, v in enumerate((1.0, x1, x2, y, x1 * x1, x2 * x2, x1 * x2, x1 * y, x2 * y)):
            self.sums[i] += sign * v

    @classmethod
    def measure(cls, time_rows: Callable[[int], float], max_rows: int,
                rounds: int = 4) -> StepCost:
        """time_rows(r): seconds of one forward pass of r rows. The rounds go up and down the
        row counts in turn: a slow spell late in an upward round slows the large counts only,
        steepening the slope that prices drafts (0.7 ms a row against 0.4 in identical engines);
        the next round, downward, meets those counts first."""
        ladder = sorted({r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
                         if r < max_rows} | {max_rows})
        best = dict.fromkeys(ladder, float("inf"))
        for i in range(rounds):
            for r in ladder if i % 2 == 0 else ladder[::-1]:
                best[r] = min(best[r], time_rows(r))
        return cls(ladder, [best[r] for r in ladder])


def _straighten(rows: list[int], seconds: list[float]) -> list[float]:
    """From LINEAR_FROM rows on, the forward is compute-bound, linear in its rows: those points
    become the least-squares line through them, so one noisy point cannot set the slope that
    prices every draft (between two neighbouring points, it did: 0.1 to 0.7 ms a row in
    identical engines)."""
    tail = [(r, t) for r, t in zip(rows, seconds) if r >= LINEAR_FROM]
    if len(tail) < 3:
        return seconds
    mr, mt = sum(r for r, _ in tail) / len(tail), sum(t for _, t in tail) / len(tail)
    slope = (sum((r - mr) * (t - mt) for r, t in tail) / sum((r - mr) ** 2 for r, _ in tail))
    return [t if r < LINEAR_FROM else mt + slope * (r - mr) for r, t in zip(rows, seconds)]


@dataclass
class Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    idle: int = 0  # steps with a proposal but no draft verified


class DraftPlanner:
    def __init__(self, max_length: int, cost: StepCost | None = None) -> None:
        self.max_length = max_length
        self.cost = cost  # None: no planning, always draft max_length
        self.kinds: dict[int, Acceptance] = {}
        self.seqs: dict[int, Acceptance] = {}  # per sequence: steps without a draft (idle)
        self.total = Acceptance(1.0, 1.0)  # the engine's running counts (prior: alpha 0.5)

    def alpha(self, kind: int) -> float:
        s, t = self.kinds.get(kind) or Acceptance(), self.total
        rate = t.accepted / (t.accepted + t.rejected)
        return (s.accepted + PRIOR * rate) / (s.accepted + s.rejected + PRIOR)

    def _pays(self, gain: float, tokens: float, rows: int, base: int, prefill: int = 0) -> bool:
        """Whether a draft expected to add `gain` tokens raises the step's tokens per second
        (by MARGIN) when the step holds `tokens` expected tokens in `rows` rows, base its own:
        gain per second of the row it adds against tokens per second of the step. A step that
        also runs `prefill` prompt rows is judged as the step without them: the prompt is
        computed either way, and its rows make no tokens (counted as tokens, they priced every
        draft of such a step out; left out of the cost, any draft would pay)."""
        marginal = self.cost(rows + 1, base) - self.cost(rows, base)
        return gain / MARGIN * self.cost(rows - prefill, base - prefill) > tokens * marginal

    def worthwhile(self, base_rows: int, prefill: int = 0) -> bool:
        """Whether a draft could pay at all this step (a certain one: a row's cost against a
        token); when not, the engine skips proposing. (Judged by the likeliest kind's rate
        before, a few early rejections could switch speculation off for good: with no drafts,
        no rate recovers.)"""
        if self.cost is None:
            return True
        rows = max(base_rows, prefill + 1)
        return self._pays(1.0, rows - prefill, rows, rows, prefill)

    def paying_drafts(self, base_rows: int, prefill: int = 0) -> int:
        """The most drafts plan() could keep for one sequence this step: its i-th draft gains at
        most best^i (best: the likeliest kind seen, or a new kind at the engine's rate), and
        a gain that does not pay at the step's base rows pays even less once drafts are kept
        (more tokens to beat, rows no cheaper). 0: plan() keeps none but explorations. The
        engine proposes at most this many drafts (a suffix proposal costs a look-up per
        drafted token), and none but explorations at 0."""
        if self.cost is None:
            return self.max_length
        t = self.total
        best = max([t.accepted / (t.accepted + t.rejected)] + [self.alpha(k) for k in self.kinds])
        rows = max(base_rows, prefill + 1)
        n = 0
        while n < self.max_length and self._pays(best ** (n + 1), rows - prefill, rows, rows,
                                                 prefill):
            n += 1
        return n

    def idle_step(self, seq_ids: list[int]) -> set[int]:
        """A step where the sequences were not proposed for (no paying drafts): each counts it as a
        step without a draft, as plan() counts one; returns those due to explore (EXPLORE
        such steps), whose proposals plan() then keeps one draft of."""
        due = set()
        for sid in seq_ids:
            state = self.seqs.setdefault(sid, Acceptance())
            state.idle += 1
            if state.idle >= EXPLORE:
                due.add(sid)
        return due

    def plan(self, proposals: dict[int, tuple[int, int]], base_rows: int,
             prefill: int = 0) -> dict[int, int]:
        """Drafts to keep per sequence of its proposal (count, kind), with base_rows rows in
        the step before any draft: one per decoding sequence, plus `prefill` prompt rows."""
        if self.cost is None:
            return {sid: min(n, self.max_length) for sid, (n, _) in proposals.items()}
        alphas = {kind: self.alpha(kind) for _, kind in proposals.values()}
        gains = sorted(((alphas[kind] ** (i + 1), sid) for sid, (n, kind) in
                        proposals.items() for i in range(min(n, self.max_length))),
                       reverse=True)
        keep = dict.fromkeys(proposals, 0)
        base = max(base_rows, prefill + 1)
        tokens, rows = float(base - prefill), base
        for gain, sid in gains:
            if not self._pays(gain, tokens, rows, base, prefill):
                break
            keep[sid] += 1
            tokens += gain
            rows += 1
        for sid, (n, _) in proposals.items():
            state = self.seqs.setdefault(sid, Acceptance())
            if n and not keep[sid]:
                state.idle += 1
                if state.idle >= EXPLORE:
                    keep[sid] = 1
            if keep[sid]:
                state.idle = 0
        return keep

    def record(self, kind: int, drafted: int, accepted: int) -> None:
        rejected = 1.0 if accepted < drafted else 0.0
        for a, decay in ((self.kinds.setdefault(kind, Acceptance()), DECAY),
                         (self.total, TOTAL_DECAY)):
            a.accepted = a.accepted * decay + accepted
            a.rejected = a.rejected * decay + rejected

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
