"""`tokenmill kv-memory` for DeepSeek V3.2 and V4: bytes per token per layer type, and totals at
128K and 1M tokens and at the asked context, in the model's dtype and in DeepSeek's formats."""

from __future__ import annotations

import json
from dataclasses import asdict

from tokenmill.kv_memory import human, print_table
from tokenmill.kv_memory_deepseek import DEEPSEEK, DeepseekCache

CONTEXTS = {"128K": 128 * 1024, "1M": 1024 * 1024}
# the engine keeps DeepSeek caches in the model's dtype (engine/cache_config.py), as
# kv_memory.report does for MLA; DEEPSEEK is DeepSeek's own fp8/fp4 formats
DTYPES = ("float32", "bfloat16", DEEPSEEK)
SHOWN = ("bfloat16", DEEPSEEK)  # the formats of the per-layer-type table


def report(cache: DeepseekCache, context: int, batch: int, memory: int | None,
           block_size: int = 16) -> list[dict]:
    rows = []
    for dtype in DTYPES:
        per_context = cache.nbytes(context, dtype, block_size)
        row = {"kv_dtype": dtype, "bytes_per_token": cache.bytes_per_token(context, dtype),
               **{f"bytes_at_{k}": cache.nbytes(n, dtype) for k, n in CONTEXTS.items()},
               "per_context_bytes": per_context, "per_batch_bytes": per_context * batch}
        if memory is not None:
            row["max_sequences"] = memory // per_context
        rows.append(row)
    return rows


def layer_type_rows(cache: DeepseekCache) -> list[dict]:
    return [{"layer_type": t.name, "layers": t.layers,
             "bytes_per_token_per_layer": {d: {k: t.bytes_per_token(n, d)
                                               for k, n in CONTEXTS.items()} for d in SHOWN}}
            for t in cache.layer_types]


def formula(cache: DeepseekCache) -> str | None:
    """The bfloat16 per-token arithmetic when every part is cached for every token."""
    parts = [p for t in cache.layer_types for p in t.parts]
    if len(cache.layer_types) > 1 or any(p.ratio != 1 or p.cap for p in parts):
        return None
    widths = " + ".join(f"{p.width} {p.name}" for p in parts)
    return (f"{cache.num_layers} layers x ({widths}) x 2 bytes (bfloat16) = "
            f"{cache.bytes_per_token(1, 'bfloat16'):,.0f} bytes")


def print_layer_types(cache: DeepseekCache) -> None:
    for t in cache.layer_types:
        state = f"; compressor state {t.state_bytes:,} B" if t.state_bytes else ""
        print(f"  {t.name} x {t.layers}: " + ", ".join(p.describe() for p in t.parts) + state)
    print("bytes per token per layer (window and state spread over the context):")
    table = [["layer type", "layers"] + [f"{d} {k}" for d in SHOWN for k in CONTEXTS]]
    for row in layer_type_rows(cache):
        per = row["bytes_per_token_per_layer"]
        table.append([row["layer_type"], str(row["layers"])]
                     + [f"{per[d][k]:,.1f}" for d in SHOWN for k in CONTEXTS])
    print_table(table)


def print_deepseek_report(cache: DeepseekCache, context: int, batch: int, memory: int | None,
                          block_size: int, as_json: bool = False) -> None:
    rows = report(cache, context, batch, memory, block_size)
    if as_json:
        print(json.dumps({"model": asdict(cache), "context": context, "batch": batch,
                          "memory": memory, "block_size": block_size,
                          "layer_types": layer_type_rows(cache), "rows": rows}))
        return
    print(f"{cache.name}: {cache.family}, {cache.num_layers} layers, "
          f"max context {cache.max_len:,}")
    print_layer_types(cache)
    if (line := formula(cache)) is not None:
        print(f"per token: {line}")
    print(f"context {context:,} tokens, batch {batch}"
          + (f", budget {human(memory)}" if memory else ""))
    header = ["kv_dtype", "bytes/token", *CONTEXTS, "per context", "per batch"]
    if memory is not None:
        header.append("max seqs")
    table = [header]
    for r in rows:
        line = [r["kv_dtype"], f"{r['bytes_per_token']:,.1f}",
                *(human(r[f"bytes_at_{k}"]) for k in CONTEXTS),
                human(r["per_context_bytes"]), human(r["per_batch_bytes"])]
        if memory is not None:
            line.append(f"{r['max_sequences']:,}")
        table.append(line)
    print_table(table)
    print(f"{DEEPSEEK}: as DeepSeek deploys it, {cache.native}"
          + ("; its compressor state is fp32 (the engine dtypes count tokenmill's: the raw "
             "pool's pending compressor inputs)" if any(
              t.state_bytes for t in cache.layer_types) else ""))
