"""What a proposer returns for one sequence, and the keys the look-up proposers index
contexts by."""

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


KEY_BITS = 21  # token ids below 2**21: every vocabulary tokenmill loads (a larger id would only
# alias contexts: worse drafts, still verified)


def context_keys(tokens: list[int], end: int, longest: int) -> list[int]:
    """Keys of the contexts tokens[end - n: end] for n = 1..longest, as ints: the tokens packed
    KEY_BITS apart above a bit that marks the length. (They were tuples: the garbage collector
    tracks tuples, not ints, and the look-up proposers' indexes of tuple keys made full
    collections, which walk every object of the process, frequent enough to cost 6-13% of
    the benchmark's 16-sequence free-writing runs.)"""
    keys, packed = [], 0
    for n in range(1, longest + 1):
        packed |= tokens[end - n] << (KEY_BITS * (n - 1))
        keys.append(packed | 1 << (KEY_BITS * n))
    return keys
