"""How many tokens to draft for each sequence next step. Drafts cost a verify row each, so a
sequence whose drafts keep failing should draft less: the length grows by one after a step that
accepted every draft and drops to (accepted + 1) after a rejection; after two steps in a row that
accepted nothing, the sequence pauses drafting for 2, 4, 8 ... up to 64 steps."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64


@dataclass
class LengthState:
    length: int
    failures: int = 0  # verify steps in a row that accepted nothing
    paused: int = 0  # steps left without drafts


class LengthController:
    def __init__(self, max_length: int, adaptive: bool = True) -> None:
        self.max_length = max_length
        self.adaptive = adaptive
        self.states: dict[int, LengthState] = {}

    def next_length(self, seq_id: int) -> int:
        """Tokens to draft for the sequence this step (0: it is paused)."""
        state = self.states.setdefault(seq_id, LengthState(self.max_length))
        if state.paused:
            state.paused -= 1
            return 0
        return state.length

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        state = self.states.get(seq_id)
        if state is None or not self.adaptive or not drafted:
            return
        if accepted == drafted:
            state.length = min(self.max_length, state.length + 1)
        else:
            state.length = accepted + 1
        state.failures = state.failures + 1 if accepted == 0 else 0
        if state.failures >= 2:
            state.paused = min(MAX_PAUSE, 2 ** (state.failures - 1))

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
