"""Shared benchmark helpers: model resolution, the transformers peer, workloads, tables."""

from __future__ import annotations

import json
import os
import random
import statistics

import torch


def resolve(model: str) -> str:
    from tokenmill.loaders.resolve import resolve_model

    return resolve_model(model)


def load_hf(path: str, dtype: torch.dtype):
    """The same weights in transformers (a GGUF is dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM

    if os.path.isfile(path) and path.endswith(".gguf"):
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def best_matmul_dtype(rows: int = 256, n: int = 3072, k: int = 576) -> torch.dtype:
    """float32 or bfloat16, whichever PyTorch's matmul runs faster on this machine (a peer's
    best setting: bf16 wins with AVX512-BF16 or AMX, float32 without them)."""
    import time

    def seconds(dtype):
        x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
        torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        return time.perf_counter() - start

    return torch.bfloat16 if seconds(torch.bfloat16) < seconds(torch.float32) else torch.float32


def random_workload(n: int, vocab: int, prompt_range, output_range, seed: int = 0):
    """n (prompt token ids, output length) pairs with uniform random lengths."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        work.append(([rng.randrange(100, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return work


def machine() -> dict:
    from tokenmill.kernels import chosen_isa
    from tokenmill.kernels.isa import describe_cpu

    return {"cpu": describe_cpu(), "kernels": chosen_isa(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


def median(values):
    return statistics.median(values) if values else None


def emit_json(result: dict) -> None:
    print(json.dumps(result, sort_keys=True))
