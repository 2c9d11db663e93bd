"""The driver's side of tensor parallelism: rank 0 lives in the engine's process, the other
ranks of this node are spawned (torch.multiprocessing, spawn), and ranks on other nodes are
started there by `tokenmill serve --node-rank R` (serve_node below). Each step, before its
own forward pass, the driver broadcasts the step plan; every rank then runs the same pass over
its shard, and the collectives inside keep them in step.

A local worker that dies is noticed within a second by a watcher thread, which ends the
process with a message (the engine cannot go on without the worker's shard, and its peers'
next collective would wait until the timeout). A remote one is noticed by the failing
collective (group.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch
import torch.distributed
import torch.multiprocessing as mp

from tokenmill.distributed.group import ParallelConfig, TPGroup, fatal, init_group
from tokenmill.distributed.worker import PlannedSeq, Setup, place_rank, run_worker

logger = logging.getLogger("tokenmill")


def _spawned_worker(rank: int, config, parallel: ParallelConfig) -> None:
    run_worker(rank, config, parallel, watch_parent=True)


class TPDriver:
    def __init__(self, config, parallel: ParallelConfig, device: torch.device) -> None:
        if parallel.node_rank != 0:
            raise ValueError("the driver (rank 0) runs on node 0; start other nodes with "
                             "serve_node (tokenmill serve --node-rank R)")
        self.parallel = parallel
        ctx = mp.get_context("spawn")
        self.procs = {rank: ctx.Process(target=_spawned_worker, args=(rank, config, parallel),
                                        name=f"tokenmill-tp-{rank}", daemon=True)
                      for rank in parallel.node_ranks if rank != 0}
        for proc in self.procs.values():
            proc.start()
        self._closing = False
        threading.Thread(target=self._watch, daemon=True, name="tokenmill-tp-watch").start()
        place_rank(0, 0, config, parallel)
        try:
            self.group: TPGroup = init_group(0, parallel, device)
        except RuntimeError:
            self._closing = True
            for proc in self.procs.values():
                proc.kill()
            raise
        self.group.explain = self._dead_worker
        atexit.register(self.shutdown)  # before multiprocessing's exit handler kills workers
        logger.info("tensor parallel: %d ranks on %d node(s), rendezvous %s:%d",
                    parallel.tensor_parallel_size, parallel.nnodes, parallel.master_addr,
                    parallel.master_port)

    def setup(self, setup: Setup) -> None:
        self.group.broadcast(setup)

    def ready(self) -> None:
        """Wait until every rank has loaded its shard."""
        self.group.broadcast(None)

    def step(self, scheduled, rows: list[int]) -> None:
        self.group.broadcast(("step", [(PlannedSeq.of(s, n), n) for s, n in scheduled], rows))

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.group.broadcast(("stop",))
        for proc in self.procs.values():
            proc.join(timeout=10)
        self.group.close()
        torch.distributed.destroy_process_group()  # a later engine in this process may start one

    def _dead_worker(self) -> str | None:
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}; the engine cannot run without its shard, so it stops")
        return None

    def _watch(self) -> None:
        while not self._closing:
            message = self._dead_worker()
            if message and not self._closing:
                fatal(message)
            time.sleep(0.5)


def serve_node(config, parallel: ParallelConfig) -> None:
    """Run this node's ranks headless (node_rank > 0): the first in this process, the others
    spawned; returns when the driver stops them."""
    ranks = list(parallel.node_ranks)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned_worker, args=(r, config, parallel), daemon=True)
             for r in ranks[1:]]
    for proc in procs:
        proc.start()
    run_worker(ranks[0], config, parallel)
