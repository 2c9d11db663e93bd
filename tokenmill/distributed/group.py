"""The tensor-parallel process group: torch.distributed over TCP rendezvous (gloo on CPU, NCCL
on CUDA, chosen by the device), and the two collectives a sharded model needs: the sum of
row-parallel outputs (all-reduce) and the concatenation of vocabulary slices (all-gather).

While a model is built, `building(group)` makes the group current, so that the layers of the
model being built learn their rank and size without every constructor taking them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks find each other. Rank r lives on node r // (size // nnodes)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29511
    timeout_s: float = 120.0  # rendezvous (and any collective) gives up after this

    def __post_init__(self) -> None:
        tp, nn = self.tensor_parallel_size, self.nnodes
        for name, value in (("tensor_parallel_size", tp), ("nnodes", nn)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if tp % nn:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of nnodes ({nn})")
        if not 0 <= self.node_rank < nn:
            raise ValueError(f"node_rank must be in [0, {nn}), got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in (0, 65536), got {self.master_port}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks that run on this node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


class TPGroup:
    """One rank's view of the group. A collective that fails (a rank died, the network went
    away, the timeout passed) ends this process with a message: the shards cannot go on
    without each other, and waiting would hang every request."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.shard = None  # sharding.Shard: what this rank holds (set once the config is known)
        self.explain = lambda: None  # the driver's: which local worker died, if one did
        self.shm = None  # shm.ShmComm when every rank is on this host (else gloo / NCCL)
        self.reduce_seconds = 0.0  # time spent in all-reduces (the share of a step they take)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        with self._fatal("all-reduce"):
            if self.shm is not None and self.shm.fits(x.numel() * x.element_size()):
                self.shm.all_reduce(x)
            elif x.dtype == torch.bfloat16 and x.device.type == "cpu":  # gloo cannot sum bf16
                y = x.float()
                dist.all_reduce(y)
                x.copy_(y)
            else:
                dist.all_reduce(x)
        self.reduce_seconds += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dimension in rank order."""
        if self.shm is not None and self.shm.fits(x.numel() * x.element_size()):
            with self._fatal("all-gather"):
                return self.shm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._fatal("all-gather"):
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj=None):
        """Rank 0's object, on every rank (pickled: only engine-made plans, never model data)."""
        with self._fatal("broadcast"):
            if self.shm is not None:
                done, value = self.shm.broadcast(obj)
                if done:
                    return value
            box = [obj]
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    @contextlib.contextmanager
    def _fatal(self, what: str):
        try:
            yield
        except (RuntimeError, ConnectionError) as e:
            time.sleep(0.2)  # let a dead worker's exit status settle, to name it
            fatal(self.explain() or f"tensor-parallel rank {self.rank}: {what} failed "
                  f"({str(e).splitlines()[0]}); another rank has died or cannot be reached, "
                  "so this one exits")


def fatal(message: str) -> None:
    """Print and end the process now (no cleanup that could wait on a dead peer)."""
    print(f"tokenmill: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int, local_rank: int, gpus: int) -> torch.device:
    """Where a rank runs: its own GPU on its node (local_rank modulo the node's GPUs), or the
    CPU."""
    if device.type != "cuda":
        return device
    if gpus < 1:
        raise RuntimeError(f"tensor-parallel rank {rank} was asked for CUDA, but no GPU is "
                           "visible")
    return torch.device("cuda", local_rank % gpus)


def init_group(rank: int, parallel: ParallelConfig, device: torch.device) -> TPGroup:
    backend = backend_for(device)
    where = f"{parallel.master_addr}:{parallel.master_port}"
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://{where}", rank=rank,
            world_size=parallel.tensor_parallel_size,
            timeout=datetime.timedelta(seconds=parallel.timeout_s))
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError is a RuntimeError
        raise RuntimeError(
            f"tensor-parallel rendezvous at {where} failed for rank {rank} of "
            f"{parallel.tensor_parallel_size} within {parallel.timeout_s:g} s (are all "
            f"{parallel.nnodes} nodes started, with the same --master-addr/--master-port?): "
            f"{str(e).splitlines()[0]}") from None
    group = TPGroup(rank, parallel.tensor_parallel_size, device)
    if use_shared_memory(parallel, device):
        from tokenmill.distributed.shm import ShmComm

        name = f"tokenmill-tp-{os.getpid()}-{parallel.master_port}" if rank == 0 else None
        create = rank == 0
        if create:
            comm = ShmComm(0, group.size, name, SLOT_BYTES, True, parallel.timeout_s,
                           lambda why: fatal(f"tensor-parallel rank 0: {why}"))
        box = [name]
        dist.broadcast_object_list(box, src=0)
        if not create:
            comm = ShmComm(rank, group.size, box[0], SLOT_BYTES, False, parallel.timeout_s,
                           lambda why: fatal(f"tensor-parallel rank {rank}: {why}"))
        dist.barrier()  # every rank has it mapped
        comm.unlink()
        group.shm = comm
    return group


SLOT_BYTES = 16 * 2**20  # per rank and parity; larger tensors go through gloo


def use_shared_memory(parallel: ParallelConfig, device: torch.device) -> bool:
    """Shared-memory collectives when every rank is on this host, on CPU, on x86 (whose stores
    are seen in order, which the flags rely on); TOKENMILL_TP_COMM=gloo turns them off."""
    import platform

    return (parallel.nnodes == 1 and device.type == "cpu"
            and platform.machine() in ("x86_64", "AMD64")
            and os.environ.get("TOKENMILL_TP_COMM", "shm") != "gloo")


_current: TPGroup | None = None


def current() -> TPGroup | None:
    """The group of the model being built (None: not sharded)."""
    return _current


@contextlib.contextmanager
def building(group: TPGroup | None):
    global _current
    previous, _current = _current, group
    try:
        yield
    finally:
        _current = previous
