"""Where start-up time goes: the engine times its phases in order (metadata, kernel library,
weights, tokenizer, KV cache, packing) and logs one line; benchmarks/startup.py prints them."""

from __future__ import annotations

import time


class Stopwatch:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase`."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._start

    def describe(self) -> str:
        parts = ", ".join(f"{name} {sec:.2f}" for name, sec in self.phases.items())
        return f"engine started in {self.total:.2f} s ({parts})"
