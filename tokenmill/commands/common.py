"""Arguments shared by commands that start an engine, and helpers to print run statistics."""

from __future__ import annotations

import argparse
import re

DEFAULT_MODEL = "smollm2-135m-instruct"

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", help="tokenizer path when it is not next to the model")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--quantization", choices=["int8", "int4", "int4-g128"],
                   help="quantize a float checkpoint's linear layers at load (a quantized "
                        "GGUF file keeps its own quantization with --dtype auto)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--block-size", type=int,
                   help="tokens per KV block (default 16; 32 with --kv-cache-dtype int4)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--kv-cache-memory", type=parse_bytes, help="KV cache budget, e.g. 2GiB")
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--threads", type=int, help="CPU threads for PyTorch")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: the same tokens and logprobs alone, batched, "
                        "chunked or prefix-cached (slower prefill; docs/performance.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is split over (one process each; --threads is per "
                        "rank)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the ranks run on")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node (0 runs the engine and serves; others run workers only)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (rendezvous)")
    g.add_argument("--master-port", type=int, help="node 0's rendezvous port (several nodes)")
    g.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="seconds a rendezvous or collective may wait for the other ranks")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
                        '\'{"model": "PATH", "num_speculative_tokens": 4}\'')


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tokenizer=args.tokenizer, dtype=args.dtype, quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.threads, speculative_config=args.speculative_config,
        deterministic=args.deterministic, tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, distributed_timeout=args.distributed_timeout,
    )


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.8) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=256)
    g.add_argument("-t", "--temperature", type=float, default=temperature)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=args.stop,
    )


def format_stats(out) -> str:
    """'prompt 12 tokens (0 cached) | TTFT 35.1 ms | mean ITL 8.2 ms | 121.9 tok/s'."""
    m = out.metrics
    n = sum(len(c.token_ids) for c in out.outputs)
    parts = [f"prompt {m.num_prompt_tokens} tokens ({m.num_cached_tokens} cached)",
             f"{n} generated"]
    if m.time_to_first_token is not None:
        parts.append(f"TTFT {m.time_to_first_token * 1e3:.1f} ms")
    if m.mean_inter_token_latency is not None:
        parts.append(f"mean ITL {m.mean_inter_token_latency * 1e3:.1f} ms")
        parts.append(f"{1.0 / m.mean_inter_token_latency:.1f} tok/s")
    if m.num_draft_tokens:
        parts.append(f"drafts {m.num_accepted_tokens}/{m.num_draft_tokens} accepted")
    return " | ".join(parts)
