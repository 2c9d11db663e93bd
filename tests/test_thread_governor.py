"""The thread governor (engine/thread_governor.py) on a simulated clock: it gives up a thread
when the steps get too little of their threads' time while the OS preempts them often (not
for a low share alone: a small model's idle threads), tries one more after a wait that doubles
with each failed try, keeps a try that holds, never goes below one or above the start, and
gives every thread back on restore()."""

import logging

from tokenmill.engine.thread_governor import ThreadGovernor


class Machine:
    """Steps of 10 ms wall time whose threads each get `share` of it (the CPU time) and are
    preempted 500 times a second when that is below 0.9 (a neighbour takes their CPU), 20
    otherwise, or `preempted` times."""

    def __init__(self, threads: int, share, preempted=None, **kw) -> None:
        self.now = self.cpu = self.switches = 0.0
        self.share = share
        self.preempted = preempted or (lambda n: 500 if share(n) < 0.9 else 20)
        self.log: list[int] = []
        self.gov = ThreadGovernor(threads, clock=lambda: self.now, cpu_clock=lambda: self.cpu,
                                  preemptions=lambda: self.switches,
                                  set_threads=self.log.append, **kw)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / 0.01)):
            with self.gov.step():
                n = self.gov.threads
                self.now += 0.01
                self.cpu += 0.01 * n * self.share(n)
                self.switches += 0.01 * n * self.preempted(n)


def test_a_shared_cpu_costs_a_thread_and_tries_come_back_less_often(caplog):
    # a neighbour on one of 2 CPUs: 2 threads get 55% each, 1 thread all of its time
    m = Machine(2, lambda n: 0.55 if n == 2 else 1.0)
    with caplog.at_level(logging.DEBUG, logger="tokenmill"):
        m.run(0.2)
    assert m.log == [1] and m.gov.threads == 1
    assert "a shared CPU" in caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.INFO
    m.run(20.0)  # tries one more after 1 s, then 2, 4, 8, 16 s: each fails
    tries = [i for i, n in enumerate(m.log) if n == 2]
    assert len(tries) == 4 and m.log == [1, 2] * 4 + [1]
    assert m.gov.threads == 1


def test_a_try_that_holds_is_kept():
    busy = [True]
    m = Machine(4, lambda n: 0.6 if busy[0] else 0.99)
    m.run(0.2)
    assert m.log == [3]
    busy[0] = False  # the neighbour left: the next tries hold, back to all four
    m.run(10.0)
    assert m.log == [3, 4] and m.gov.threads == 4
    m.run(5.0)  # stays there while every thread has its CPU
    assert m.log == [3, 4]


def test_never_below_one_thread_nor_when_off():
    m = Machine(2, lambda n: 0.3)
    m.run(3.0)
    assert min(m.log) == 1 and m.gov.threads in (1, 2)
    off = Machine(2, lambda n: 0.3, enabled=False)
    off.run(3.0)
    assert off.log == [] and off.gov.threads == 2
    one = Machine(1, lambda n: 0.3)
    one.run(3.0)
    assert one.log == []


def test_a_low_share_without_preemption_keeps_the_threads():
    # a model too small to keep 2 threads busy: half their time idle, but never preempted
    m = Machine(2, lambda n: 0.5, preempted=lambda n: 20)
    m.run(3.0)
    assert m.log == [] and m.gov.threads == 2


def test_restore_gives_every_thread_back():
    m = Machine(4, lambda n: 0.5)
    m.run(0.6)
    assert m.gov.threads == 1 and m.log == [3, 2, 1]
    m.gov.restore()
    assert m.gov.threads == 4 and m.log[-1] == 4
    m.gov.restore()  # nothing to give back: no call
    assert m.log == [3, 2, 1, 4]


def test_an_engine_gives_its_threads_back_when_collected(tiny_llama, monkeypatch):
    import gc

    import torch

    from tokenmill import LLM

    path, _ = tiny_llama
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=2)
        gov = llm.engine.governor
        assert gov.enabled and gov.max == 2
        gov._change(1, 0.0, logging.DEBUG, "test")  # as under a busy neighbour
        assert torch.get_num_threads() == 1
        del llm, gov
        gc.collect()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
