"""What a proposer returns for one sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: list[int]  # the drafted tokens, best guess first
    probs: torch.Tensor | None = None  # (tokens, vocab) the draft model's q; None: a point mass
    # Which kind of guess this is, for the planner's acceptance statistics: drafts of one kind
    # are accepted alike (the n-gram and suffix proposers: the matched length).
    kind: int = 0
