"""Helpers for the offline benchmarks: engine arguments, random prompts, weight bytes."""

from __future__ import annotations

import json
import random


def add_model_args(p, default_model: str) -> None:
    from tokenmill.commands.common import add_engine_args

    p.add_argument("model", nargs="?", default=default_model,
                   help=f"model path or name (default: {default_model})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kernels", action="store_true", help="PyTorch reference ops only")
    add_engine_args(p)


def make_llm(args, **overrides):
    from tokenmill import LLM
    from tokenmill.commands.common import engine_kwargs

    kwargs = {**engine_kwargs(args), "use_kernels": not args.no_kernels, **overrides}
    return LLM(args.model, **kwargs)


def random_prompt(rng: random.Random, vocab: int, length: int) -> dict:
    """Random token ids (skipping the low ids where special tokens usually live)."""
    low = min(100, vocab // 2)
    return {"prompt_token_ids": [rng.randrange(low, vocab) for _ in range(length)]}


def weight_bytes_per_token(model) -> int:
    """Bytes a decode step must read: every matmul weight (the LM head included, even when it
    shares the embedding table) plus norms; the embedding lookup reads one row only. A
    quantized weight counts its packed bytes (codes and scales)."""
    from tokenmill.layers.linear import quant_of

    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or name.endswith("embed_tokens.weight") and not _tied(model):
            continue
        seen.add(id(p))
        q = quant_of(p)
        if q is None:
            total += p.numel() * p.element_size()
        else:  # the kernels' packed bytes (the reference keeps a BlockQuant)
            total += q.packed.numel() if hasattr(q, "packed") else q.codes.numel()
    return total


def weight_format(model) -> str:
    """'float', or how many weight matrices run quantized with which code width."""
    from collections import Counter

    from tokenmill.layers.linear import quant_of

    bits, floats, seen = Counter(), 0, set()
    for p in model.parameters():
        if p.dim() != 2 or id(p) in seen:
            continue
        seen.add(id(p))
        q = quant_of(p)
        if q is None:
            floats += 1
        else:
            bits[q.bits] += 1
    if not bits:
        return "float"
    parts = [f"{n} x {b}-bit" for b, n in sorted(bits.items())]
    return "quantized " + ", ".join(parts + ([f"{floats} float"] if floats else []))


def _tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def emit(result: dict) -> None:
    print(json.dumps(result, sort_keys=True))
