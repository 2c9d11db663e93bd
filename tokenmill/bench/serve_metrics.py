"""Serving-benchmark statistics with `vllm bench serve`'s definitions, and its result table.

TTFT: first chunk - send. TPOT (per request, excluding the first token): (latency - TTFT) /
(output_tokens - 1). ITL: every gap between consecutive chunks of every request, pooled. Mean,
median and p99 (numpy's linear-interpolated percentile) in milliseconds.
"""

from __future__ import annotations

import numpy as np

from tokenmill.bench.openai_client import RequestResult

STATS = (("ttft", "Time to First Token", "TTFT"),
         ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
         ("itl", "Inter-token Latency", "ITL"))


def output_tokens(r: RequestResult) -> int:
    """Tokens from the server's usage; without usage, one per chunk (an estimate)."""
    return r.output_tokens or r.num_chunks


def _summary(name: str, seconds: list[float]) -> dict:
    ms = np.asarray(seconds, dtype=float) * 1e3 if seconds else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def calculate_metrics(results: list[RequestResult], duration: float,
                      input_lens: list[int]) -> dict:
    """input_lens: prompt lengths to fall back on when the server reports no usage."""
    ok = [(r, n) for r, n in zip(results, input_lens) if r.success]
    outs = [output_tokens(r) for r, _ in ok]
    total_in = sum(r.prompt_tokens or n for r, n in ok)
    tpots = [(r.latency - r.ttft) / (k - 1) for (r, _), k in zip(ok, outs) if k > 1]
    metrics = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": sum(outs),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(outs) / duration,
        "total_token_throughput": (total_in + sum(outs)) / duration,
    }
    metrics.update(_summary("ttft", [r.ttft for r, _ in ok]))
    metrics.update(_summary("tpot", tpots))
    metrics.update(_summary("itl", [gap for r, _ in ok for gap in r.itl]))
    metrics.update(_summary("e2el", [r.latency for r, _ in ok]))
    return metrics


def format_table(m: dict, request_rate: float, max_concurrency: int | None) -> str:
    rows = [("Traffic request rate", f"{request_rate}"),
            ("Maximum request concurrency", f"{max_concurrency}"),
            ("Successful requests", f"{m['completed']}"),
            ("Failed requests", f"{m['failed']}"),
            ("Benchmark duration (s)", f"{m['duration']:.2f}"),
            ("Total input tokens", f"{m['total_input_tokens']}"),
            ("Total generated tokens", f"{m['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}")]
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{k + ':':<40}{v:<10}" for k, v in rows]
    for key, title, short in STATS:
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):"
            lines.append(f"{label:<40}{m[f'{stat}_{key}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
