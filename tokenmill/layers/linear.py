"""Linear layer whose output may be several projections fused side by side (q|k|v, gate|up):
one matmul reads the input once. `sizes` records each part's width for split(). Also the
embedding table, built like the other layers: uninitialized, for the checkpoint to fill.

Either may hold a quantized weight (tokenmill/quantization): its parameter then keeps only its
shape (no storage) and `weight.quant` holds what the op implementation executes (the kernels'
repacked codes); a tied LM head shares it with the embedding through the shared parameter.
A float weight the packed GEMM runs alone drops its rows the same way (drop_row_copies), and
a tied embedding then reads its lookups' rows back from the LM head's panels.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.quantization import QuantWeight


def set_quantized(module: nn.Module, bq: QuantWeight | list[QuantWeight]) -> None:
    """Give module.weight the quantized form `bq`, or of its parts stacked along the output
    rows (same input order; packed by the module's op implementation)."""
    parts = bq if isinstance(bq, list) else [bq]
    weight = module.weight
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    if tuple(weight.shape) != shape:
        raise ValueError(f"quantized weight of shape {shape} for a {tuple(weight.shape)} "
                         f"parameter")
    weight.quant = module.ops.pack_quantized(parts)
    weight.data = torch.empty(1, dtype=weight.dtype, device=weight.device).expand(weight.shape)
    module.input_perm = parts[0].perm


def quant_of(weight: torch.Tensor):
    """The packed quantized form of a parameter, or None for a float one."""
    return getattr(weight, "quant", None)


class Linear(nn.Module):
    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.sizes = list(sizes)
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(sizes))) if bias else None
        self.ops = ops.current()
        self.quantize_on_load: str | None = None  # an rtn.METHODS name: quantize float weights
        self.input_perm: torch.Tensor | None = None  # input columns' order (act-order GPTQ)
        self._shards: dict = {}  # checkpoint parts received while a quantized weight assembles
        self._prepared: tuple[tuple, object] | None = None
        # a gate|up layer whose output only ever feeds silu_mul (ops.linear_act): the op
        # implementation may pack it so that its GEMM applies silu_mul as it stores
        self.gated = False
        # tensor parallelism (distributed/parallelize.py): (group, "reduce", None) sums the
        # ranks' partial outputs; (group, "gather", vocab) concatenates their vocabulary slices
        self.tp: tuple | None = None

    def shard(self, index: int) -> slice:
        """Output rows of the index-th fused projection."""
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def takes_quantized(self, tensor) -> bool:
        """Whether load_shard must take this checkpoint part (rather than a plain copy)."""
        return isinstance(tensor, QuantWeight) or bool(self._shards) or (
            self.quantize_on_load is not None)

    def load_shard(self, index: int | None, tensor) -> None:
        """One fused part (index; None when unfused) of the weight, float or QuantWeight. Once
        every part is in: quantized when all parts are (or quantize_on_load is set), else the
        quantized parts are dequantized into the float weight."""
        from tokenmill.quantization.rtn import quantize

        rows = self.sizes[index] if index is not None else self.weight.shape[0]
        if tuple(tensor.shape) != (rows, self.weight.shape[1]):
            raise ValueError(f"checkpoint part {index} of a {tuple(self.weight.shape)} linear "
                             f"has shape {tuple(tensor.shape)}, expected "
                             f"{(rows, self.weight.shape[1])}")
        if self.quantize_on_load and not isinstance(tensor, QuantWeight):
            tensor = quantize(tensor, self.quantize_on_load)
        self._shards[index] = tensor
        if len(self._shards) < max(len(self.sizes), 1) and index is not None:
            return
        parts = [self._shards[i] for i in sorted(self._shards, key=lambda i: i or 0)]
        self._shards = {}
        if all(isinstance(p, QuantWeight) for p in parts) and QuantWeight.same_order(parts):
            return set_quantized(self, parts)
        with torch.no_grad():
            self.weight.copy_(torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p
                                         for p in parts]))

    def prepared(self):
        """What the op implementation precomputes from the weight (the C++ GEMM's packed
        panels and its GEMM plan), computed on first use and again whenever the weight or bias
        is replaced or written in place (not once its rows are dropped: drop_rows)."""
        if self.rows_dropped:
            return self._prepared[1]
        key = tuple((t.data_ptr(), t._version) for t in (self.weight, self.bias) if t is not None)
        if self._prepared is None or self._prepared[0] != key:
            gated = self.gated and self.tp is None and self.input_perm is None
            self._prepared = (key, self.ops.prepare_linear(self.weight, self.bias, gated))
        return self._prepared[1]

    @property
    def rows_dropped(self) -> bool:
        return getattr(self.weight, "rows_dropped", False)

    def rows(self) -> torch.Tensor:
        """The float weight's rows: the parameter's, or rebuilt once dropped (drop_rows)."""
        return self.ops.dropped_rows(self.prepared()) if self.rows_dropped else self.weight

    def drop_rows(self) -> bool:
        """Free the float weight's rows when the op implementation runs every call from what
        it prepared (ops.runs_prepared_only); they are rebuilt from it for any call that needs
        them (ops.linear's fallbacks). The parameter keeps its shape, as a quantized one does.
        Returns whether the rows were dropped."""
        if self.rows_dropped or quant_of(self.weight) is not None:
            return self.rows_dropped
        prepared = self.prepared()
        if not self.ops.runs_prepared_only(prepared):
            return False
        w = self.weight
        w.data = torch.empty(1, dtype=w.dtype, device=w.device).expand(w.shape)
        w.rows_dropped = True
        w.prepared_from = prepared  # where a tied embedding reads its rows (Embedding._lookup)
        return True

    def forward(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        if self.tp is None:
            return self.ops.linear(x, self, out_fp32)
        group, mode, vocab = self.tp
        if mode == "gather":
            return group.all_gather(self.ops.linear(x, self, out_fp32))[..., :vocab]
        # the ranks' partial sums added in float32 and rounded once, as one rank's GEMM would
        out = group.all_reduce(self.ops.linear(x, self, out_fp32=True))
        return out if out_fp32 else out.to(x.dtype)


class Embedding(nn.Embedding):
    """nn.Embedding without its random init (the checkpoint overwrites it; under the meta
    device the init also imported ~1 s of PyTorch's reference decompositions at start), whose
    table may be quantized (rows dequantized on lookup)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num, dim, _weight=torch.empty(num, dim))
        self.ops = ops.current()
        self.tp: tuple | None = None  # (group, first row, end): this rank's vocabulary rows

    def takes_quantized(self, tensor) -> bool:
        return isinstance(tensor, QuantWeight)

    def load_shard(self, index: int | None, tensor: QuantWeight) -> None:
        set_quantized(self, tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(ids)
        group, start, end = self.tp  # ids outside this rank's rows: zeros, summed in by others
        outside = (ids < start) | (ids >= end)
        rows = self._lookup((ids - start).masked_fill(outside, 0))
        return group.all_reduce(rows.masked_fill_(outside[..., None], 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        q = quant_of(self.weight)
        if q is not None:
            rows = self.ops.quantized_rows(q, ids.reshape(-1))
        elif getattr(self.weight, "rows_dropped", False):  # a tied LM head's panels hold them
            rows = self.ops.dropped_rows(self.weight.prepared_from, ids.reshape(-1))
        else:
            return super().forward(ids)
        return rows.to(self.weight.dtype).reshape(*ids.shape, -1)


def embedding(num: int, dim: int) -> Embedding:
    return Embedding(num, dim)


def drop_row_copies(model: nn.Module, release: Callable[[], bool] = lambda: False) -> int:
    """Pack every linear layer of `model`; drop the row-major copy (half a float model's
    memory) of each weight the packed GEMM runs alone (Linear.drop_rows), unless a module other
    than an embedding shares it (a tied LM head's embedding reads its lookups' rows from the
    panels). The panels come from fresh mappings (kernels/weight_arena.py), not the heap's
    free lists, so `release` (glibc's malloc_trim) gives the load's temporaries and each 8 MiB
    of dropped rows back to the OS as packing goes: else the start-up peak holds every row and
    every panel at once. Returns the bytes dropped."""
    users = defaultdict(list)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)].append(module)
    trims = release()
    dropped = unreleased = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        module.prepared()
        others = [m for m in users[id(module.weight)] if m is not module]
        if all(isinstance(m, Embedding) for m in others) and module.drop_rows():
            nbytes = module.weight.numel() * module.weight.element_size()
            dropped, unreleased = dropped + nbytes, unreleased + nbytes
            if trims and unreleased >= 8 << 20:
                trims, unreleased = release(), 0
    return dropped
