"""Turn a model built from a rank's local config (sharding.py) into its part of the whole:
the row-parallel projections sum their outputs across ranks, the embedding looks up its
vocabulary rows only, and the LM head gathers every rank's logits. The fused C++ decode step
(which runs whole layers without communicating) is switched off."""

from __future__ import annotations

from torch import nn

from tokenmill.distributed.group import TPGroup
from tokenmill.distributed.sharding import VOCAB_PARALLEL, Shard
from tokenmill.layers.linear import Embedding, Linear

ROW_PARALLEL = ("o_proj", "down_proj", "c_proj")


def parallelize(model: nn.Module, group: TPGroup, shard: Shard) -> nn.Module:
    vocab = shard.cfg.vocab_size
    rows = shard.vocab_rows()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear) and leaf in ROW_PARALLEL:
            module.tp = (group, "reduce", None)
        elif isinstance(module, Linear) and leaf == "lm_head":
            module.tp = (group, "gather", vocab)
        elif isinstance(module, Embedding) and leaf in VOCAB_PARALLEL:
            module.tp = (group, rows.start, rows.stop)
        if hasattr(module, "_fused"):
            module._fused = False  # no fused decode step: it cannot all-reduce mid-layer
    return model
