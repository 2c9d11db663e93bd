"""`tokenmill kv-memory MODEL`: how much KV cache a model needs, per KV dtype."""

from __future__ import annotations

from tokenmill.commands.common import parse_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("kv-memory", help="KV cache bytes per token / context / batch")
    p.add_argument("model", help="HF folder (config.json is enough), GGUF file, model name, or a "
                                 "known shape: llama-2-70b, llama-3.1-70b, llama-3-8b, ..., "
                                 "deepseek-v3.2, deepseek-v4-flash, deepseek-v4-pro")
    p.add_argument("--context", type=int, help="tokens per sequence (default: the model's max)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--memory", type=parse_bytes, help="KV budget, e.g. 24GiB: max sequences")
    p.add_argument("--block-size", type=int,
                   help="tokens per KV block (default: each KV dtype's, as the engine's)")
    p.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the model's dtype, which int4's stage (open blocks' keys) is kept in")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from tokenmill.kv_memory import load_shape, print_report
    from tokenmill.kv_memory_deepseek import load_deepseek

    cache = load_deepseek(args.model)  # V3.2 and V4 cache more than K/V: their own report
    if cache is not None:
        from tokenmill.kv_memory_deepseek_report import print_deepseek_report

        print_deepseek_report(cache, args.context or cache.max_len, args.batch, args.memory,
                              args.block_size or 16, args.json)
        return 0
    import torch

    shape = load_shape(args.model)
    print_report(shape, args.context or shape.max_len, args.batch, args.memory,
                 args.block_size, args.json, getattr(torch, args.model_dtype))
    return 0
