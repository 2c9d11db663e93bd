"""Fewer compute threads while another process shares the CPU.

A step's threads meet at many points (the kernels' parallel loops, PyTorch's ops), so a thread
the OS has descheduled for a neighbour's sake holds up the others: beside one busy process on a
2-vCPU machine, decode with 2 threads ran 2-3x slower than with 1 (docs/performance.md, "Stop
58"). The governor watches the CPU time the model's steps get: the process's CPU time over
their wall time and thread count, ~1.0 when every thread has a CPU (waiting threads spin), ~0.55
beside one busy process on 2 vCPUs; and how often the OS preempted the process's threads:
~20 times a second a thread alone, ~500 beside the busy process (a model too small to keep
its threads busy also reads a low share, but is not preempted). Over a window of step time
with both past their thresholds, it gives up one thread; after `probe` seconds at fewer
threads it tries one more again, kept if the window after it is busy enough (a thread fewer
makes the share 1.0 whether or not the neighbour is still there); each failed try doubles the
wait, up to 16x. Changes are logged.
TOKENMILL_ADAPT_THREADS=0 turns it off; it is off in deterministic mode (PyTorch's reductions
split by thread count) and with tensor parallelism (each rank's threads are its own).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from contextlib import contextmanager

import torch

logger = logging.getLogger("tokenmill")


class ThreadGovernor:
    PREEMPTIONS = 100  # a second of step time per thread, from which the CPU counts as shared

    def __init__(self, threads: int, enabled: bool = True, window: float = 0.2,
                 probe: float = 1.0, set_threads=torch.set_num_threads,
                 clock=time.perf_counter, cpu_clock=time.process_time,
                 preemptions=lambda: resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw) -> None:
        self.max = self.threads = threads
        self.enabled = enabled and threads > 1
        self.window, self.probe = window, probe
        self._set, self._clock, self._cpu, self._preempted = (set_threads, clock, cpu_clock,
                                                               preemptions)
        self._wall = self._used = self._switches = 0.0
        self._changed = clock()
        self._probing = False
        self._wait = probe  # before the next try: probe, doubled by each failed try

    @staticmethod
    def for_engine(device: torch.device, deterministic: bool, tensor_parallel: bool):
        """The engine's governor: enabled on CPU with 2+ threads unless turned off."""
        return ThreadGovernor(torch.get_num_threads(), enabled=(
            device.type == "cpu" and not deterministic and not tensor_parallel
            and os.environ.get("TOKENMILL_ADAPT_THREADS", "1") != "0"))

    def threshold(self) -> float:
        """The share of its threads' time the step must get: missing half a CPU's worth at 2
        threads (0.75) and up to 4 (0.875), at most 0.9."""
        return min(0.9, 1.0 - 0.5 / self.threads)

    @contextmanager
    def step(self):
        """Around a model step: its wall and CPU time count towards the window."""
        if not self.enabled:
            yield
            return
        wall, used, switches = self._clock(), self._cpu(), self._preempted()
        try:
            yield
        finally:
            self._wall += self._clock() - wall
            self._used += self._cpu() - used
            self._switches += self._preempted() - switches
            if self._wall >= self.window:
                self._decide()

    def restore(self) -> None:
        """Every thread back (the engine closes: the thread count is the process's)."""
        if self.threads != self.max:
            self.threads = self.max
            self._set(self.max)

    def _decide(self) -> None:
        share = self._used / (self._wall * self.threads)
        preempted = self._switches / (self._wall * self.threads)  # a thread, a second
        self._wall = self._used = self._switches = 0.0
        now = self._clock()
        probing, self._probing = self._probing, False
        if share < self.threshold() and preempted >= self.PREEMPTIONS and self.threads > 1:
            self._wait = min(2 * self._wait, 16 * self.probe) if probing else self.probe
            # logged once, not after each failed try
            self._change(self.threads - 1, now, logging.DEBUG if probing else logging.INFO,
                         f"the steps got {share:.0%} of their threads' time, each preempted "
                         f"{preempted:.0f} times a second (a shared CPU)")
            return
        if probing:
            self._wait = self.probe  # the try held
        if self.threads < self.max and now - self._changed >= self._wait:
            self._probing = True
            self._change(self.threads + 1, now, logging.DEBUG, "trying one more")

    def _change(self, threads: int, now: float, level: int, why: str) -> None:
        logger.log(level, "compute threads %d -> %d of %d: %s", self.threads, threads,
                   self.max, why)
        self.threads, self._changed = threads, now
        self._set(threads)
