"""A tensor-parallel worker: one process per rank other than the driver's rank 0. It joins the
group, receives the driver's setup (the model config and the KV cache plan), loads its shard,
builds its KV cache for its KV heads, then runs every step the driver broadcasts: the same
forward pass over its shard, whose collectives pair with the driver's. It samples nothing.

The step plan is what ModelRunner.prepare reads of each scheduled sequence (PlannedSeq):
tokens, positions, block tables, the prompt's length. The scheduler and block manager live in
the driver only.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from tokenmill.distributed.group import (
    ParallelConfig,
    TPGroup,
    building,
    fatal,
    init_group,
    rank_device,
)


@dataclass
class PlannedSeq:
    """One scheduled sequence as a step plan carries it (see ModelRunner.prepare)."""

    num_computed_tokens: int
    tokens: list[int]  # the tokens this step feeds
    block_tables: list[list[int]]
    decode: bool  # runs as decode rows
    stage_tables: list[list[int]]  # a staged KV cache's (int4)
    num_prompt_tokens: int  # its prompt's length (which rows are prompt tokens)

    @classmethod
    def of(cls, seq, n: int) -> PlannedSeq:
        first = seq.num_computed_tokens
        return cls(first, seq.step_token_ids(first, n), seq.block_tables, seq.runs_as_decode(n),
                   seq.stage_tables, seq.num_prompt_tokens)

    def step_token_ids(self, first: int, n: int) -> list[int]:
        return self.tokens

    def runs_as_decode(self, n: int) -> bool:
        return self.decode


@dataclass
class Setup:
    """What the driver decided and every rank must share (a node started with other flags
    still runs the driver's engine config)."""

    config: object  # the driver's EngineConfig
    model_path: str
    model_config: object  # the whole model's ModelConfig
    groups: tuple  # the KV cache plan's CacheGroups
    kv_dtype: str
    max_model_len: int


def load_shard(group: TPGroup, config, setup: Setup, device: torch.device, backend):
    """This rank's model: built from its local config, the checkpoint cut to its part."""
    from tokenmill.distributed.sharding import Shard
    from tokenmill.loaders import load_model

    group.shard = Shard(setup.model_config, group.rank, group.size)
    with building(group):
        model, _, dtype = load_model(setup.model_path, config.dtype, device, setup.max_model_len,
                                     backend, config.quantization)
    return model, dtype


def place_rank(rank: int, local_rank: int, config, parallel: ParallelConfig) -> None:
    """Pin this rank to its CPUs if TOKENMILL_TP_CPUS lists them (one list per local rank,
    separated by ';', e.g. "0-15;16-31": a NUMA node each), and set its thread count:
    --threads, else its CPUs, else the node's CPUs shared out among its ranks."""
    lists = [s for s in os.environ.get("TOKENMILL_TP_CPUS", "").split(";") if s.strip()]
    cpus = None
    if lists:
        if len(lists) != parallel.ranks_per_node:
            raise ValueError(f"TOKENMILL_TP_CPUS lists {len(lists)} CPU sets for "
                             f"{parallel.ranks_per_node} ranks on this node")
        cpus = _cpu_list(lists[local_rank])
        os.sched_setaffinity(0, cpus)
    threads = config.num_threads or (len(cpus) if cpus else max(
        1, (os.cpu_count() or 1) // parallel.ranks_per_node))
    torch.set_num_threads(threads)


def _cpu_list(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}"""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def run_worker(rank: int, config, parallel: ParallelConfig, watch_parent: bool = False) -> None:
    """The body of a worker process (spawned, or started on another node). watch_parent: exit
    when the process that spawned this one is gone."""
    from tokenmill.engine.cache_config import resolve_device
    from tokenmill.engine.model_runner import ModelRunner
    from tokenmill.layers import ops

    if watch_parent:
        _exit_with_parent()
    place_rank(rank, rank - parallel.node_ranks.start, config, parallel)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = rank_device(resolve_device(config.device), rank,
                         rank - parallel.node_ranks.start, gpus)
    group = init_group(rank, parallel, device)
    setup: Setup = group.broadcast()
    config = setup.config
    backend = ops.select(config.use_kernels, device, config.deterministic)
    model, _ = load_shard(group, config, setup, device, backend)
    runner = ModelRunner(model, group.shard.local, setup.groups, config.block_size,
                         setup.kv_dtype, device, config.seed, backend=backend)
    runner.prepare_weights()
    group.broadcast()  # loaded: the driver waits for every rank before serving
    with torch.inference_mode():
        while True:
            msg = group.broadcast()
            if msg[0] == "stop":
                break
            if msg[0] == "step":
                runner.run(msg[1], msg[2])
    os._exit(0)  # no destroy_process_group: a peer may already be gone


def _exit_with_parent() -> None:
    """A spawned worker whose driver is gone has nothing to do: exit (checked every second)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                fatal("tensor-parallel worker: its parent process is gone; exiting")

    threading.Thread(target=watch, daemon=True, name="tokenmill-tp-parent").start()
