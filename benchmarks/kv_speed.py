"""Decode speed by KV cache dtype: a step of 16 sequences with 2,048 tokens of context each,
and one sequence at ~8K tokens (8,100: the model's limit is 8,192), default model, same run;
only steps after every prompt is in are timed, the dtypes' engines stepping in turn. Quantized
caches are written and read in place by the kernels (kernels/csrc/kv_store.cpp,
attention_quant.cpp). Also prefill over a
long quantized history: 512 new tokens after a 4,096-token prefix-cache hit, with the kernel
that reads the pages a tile at a time (attention_prefill.cpp) and with the plain path it
replaced (gather the history, dequantize it, SDPA). Prints a table and ends with one JSON
line.

    python benchmarks/kv_speed.py [--dtypes bfloat16,int8,fp8_e4m3,int4] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_ms(kvs: list[str], seqs: int, context: int, threads: int, steps: int = 40
            ) -> dict[str, float]:
    """Per KV dtype, the median time of a decode step of `seqs` sequences together after
    `context`-token prompts (distinct, so nothing is shared through the prefix cache). One
    engine per dtype, all in this process; once every engine is decoding, their steps
    alternate (A B C A B C ...), so the machine's drift (these shared VMs move 20-40% between
    runs) falls on all of them alike."""
    import time

    from tokenmill import LLM, SamplingParams

    per_token = 2 * 30 * 3 * 64 * 2  # bf16 bytes of SmolLM2-135M: enough for every dtype
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(context)] for _ in range(seqs)]
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    engines = {}
    for kv in kvs:
        engine = LLM("smollm2-135m-instruct", kv_cache_dtype=kv, max_num_seqs=seqs,
                     max_model_len=context + steps + 16, num_threads=threads,
                     kv_cache_memory=seqs * (context + steps + 48) * per_token,
                     max_num_batched_tokens=2048).engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        while any(s.num_uncomputed_tokens > 1 or not s.num_output_tokens
                  for s in engine.scheduler.running + list(engine.scheduler.waiting)):
            engine.step()  # prefill (and the first tokens)
        engines[kv] = engine
    times = {kv: [] for kv in kvs}
    for _ in range(steps):
        for kv, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[kv].append(time.perf_counter() - start)
    return {kv: 1e3 * statistics.median(t) for kv, t in times.items()}


def prefill_ms(kv: str, threads: int, plain: bool, prefix: int = 4096, new: int = 512) -> float:
    """Median time to the first token of `new` prompt tokens after a `prefix`-token prefix
    cache hit (three different continuations); plain: without the quantized-page kernel."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.kernel_ops import KernelOps

    real = KernelOps.prefill_attention_quant
    if plain:
        KernelOps.prefill_attention_quant = lambda *a, **k: None
    try:
        llm = LLM("smollm2-135m-instruct", kv_cache_dtype=kv, max_num_seqs=1,
                  max_model_len=prefix + new + 16, num_threads=threads,
                  max_num_batched_tokens=new, enable_prefix_caching=True)
        rng = random.Random(1)
        head = [rng.randrange(100, 40000) for _ in range(prefix)]
        params = SamplingParams(temperature=0, max_tokens=1)
        llm.generate({"prompt_token_ids": head}, params, use_tqdm=False)
        times = []
        for _ in range(3):
            tail = [rng.randrange(100, 40000) for _ in range(new)]
            out = llm.generate({"prompt_token_ids": head + tail}, params, use_tqdm=False)[0]
            assert out.metrics.num_cached_tokens >= prefix - 16
            times.append(out.metrics.first_token_time - out.metrics.first_scheduled_time)
        return 1e3 * statistics.median(times)
    finally:
        KernelOps.prefill_attention_quant = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,int8,fp8_e4m3,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-prefill", action="store_true", help="decode steps only")
    args = ap.parse_args()
    from tokenmill.kernels.isa import describe_cpu

    kvs = args.dtypes.split(",")
    batch = step_ms(kvs, 16, 2048, args.threads)
    single = step_ms(kvs, 1, 8100, args.threads, steps=60)
    rows = {}
    for kv in kvs:
        rows[kv] = {"batch16_ctx2048_ms": batch[kv], "single_ctx8192_ms": single[kv]}
        if args.no_prefill:
            continue
        rows[kv]["prefill512_after4096_ms"] = prefill_ms(kv, args.threads, False)
        if kv not in ("bfloat16", "float32", "float16") and not args.no_prefill:
            rows[kv]["prefill512_after4096_plain_ms"] = prefill_ms(kv, args.threads, True)
        print(f"{kv}: done", file=sys.stderr)
    base = rows.get("bfloat16")
    print(f"{describe_cpu()}, {args.threads} threads, SmolLM2-135M-Instruct (default weights)")
    print(f"{'kv dtype':<10}{'16 x 2048 step ms':>19}{'vs bf16':>9}{'1 x 8192 ITL ms':>17}"
          f"{'vs bf16':>9}{'prefill 512 @4K ms':>20}{'plain path ms':>15}")
    for kv, r in rows.items():
        a = r["batch16_ctx2048_ms"] / base["batch16_ctx2048_ms"] if base else float("nan")
        b = r["single_ctx8192_ms"] / base["single_ctx8192_ms"] if base else float("nan")
        print(f"{kv:<10}{r['batch16_ctx2048_ms']:>19.1f}{a:>8.2f}x"
              f"{r['single_ctx8192_ms']:>17.2f}{b:>8.2f}x"
              f"{r.get('prefill512_after4096_ms', float('nan')):>20.1f}"
              f"{r.get('prefill512_after4096_plain_ms', float('nan')):>15.1f}")
    print(json.dumps({"benchmark": "kv_speed", "cpu": describe_cpu(), "threads": args.threads,
                      "results": rows}, sort_keys=True))


if __name__ == "__main__":
    main()
