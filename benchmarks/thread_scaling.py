"""Thread scaling: prefill (pp512) and decode (tg128 after 128 tokens) at each thread count, for
tokenmill (a fresh process per count: its OpenMP pool starts clean) and llama.cpp (llama-bench
-t), same BF16 weights. The other benchmarks run 2 threads, as the shared 2-vCPU machines here
have; this one says what a user with more cores gets. Set OMP_WAIT_POLICY etc. in the
environment to compare thread-pool settings (children inherit it). Prints a table and ends
with one JSON line.

    python benchmarks/thread_scaling.py [--threads 1,2,4,8,16] [--model NAME_OR_PATH] [--gen 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bf16_model import bf16_gguf  # noqa: E402
from benchmarks.compare_llamacpp import llama_bench, tokenmill_bench  # noqa: E402


def tokenmill_at(gguf: Path, threads: int, prompt: int, gen: int) -> dict:
    """This script again as a child process (its OpenMP pool starts clean at `threads`)."""
    cmd = [sys.executable, __file__, "--child", "--model", str(gguf), "--threads", str(threads),
           "--prompt", str(prompt), "--gen", str(gen)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tokenmill at {threads} threads failed: {proc.stderr[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(args) -> None:
    from tokenmill import LLM

    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=1, enable_prefix_caching=False,
              max_model_len=args.prompt + args.gen + 256, num_threads=int(args.threads))
    rng = random.Random(0)
    tokenmill_bench(llm, 64, 8, rng)  # warm-up, as compare_llamacpp
    print(json.dumps(tokenmill_bench(llm, args.prompt, args.gen, rng)))


def default_threads() -> str:
    cores = os.cpu_count() or 1
    counts = sorted({1, *(2 ** i for i in range(1, 8) if 2 ** i < cores), cores})
    return ",".join(map(str, counts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", default=default_threads())
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from tokenmill.kernels import chosen_isa
    from tokenmill.kernels.isa import describe_cpu

    gguf = bf16_gguf(args.model)
    rows = []
    for t in map(int, args.threads.split(",")):
        row = {"threads": t, "tokenmill": tokenmill_at(gguf, t, args.prompt, args.gen)}
        if not args.skip_llama:
            row["llama.cpp"] = llama_bench(gguf, t, args.prompt, args.gen)
        rows.append(row)
        print(json.dumps(row), flush=True)
    waits = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}
    print(f"\n{gguf.name}, {describe_cpu()}, {chosen_isa()} kernels, {os.cpu_count()} CPUs"
          f"{', ' + str(waits) if waits else ''}")
    print(f"{'threads':>7} {'tm pp':>8} {'llama pp':>9} {'ratio':>6} {'tm tg':>8} "
          f"{'llama tg':>9} {'ratio':>6}")
    for r in rows:
        tm, ll = r["tokenmill"], r.get("llama.cpp")
        pp = f"{ll['prefill_tok_s']:>9.0f} {tm['prefill_tok_s'] / ll['prefill_tok_s']:>5.2f}x" \
            if ll else f"{'':>9} {'':>6}"
        tg = f"{ll['decode_tok_s']:>9.1f} {tm['decode_tok_s'] / ll['decode_tok_s']:>5.2f}x" \
            if ll else ""
        print(f"{r['threads']:>7} {tm['prefill_tok_s']:>8.0f} {pp} {tm['decode_tok_s']:>8.1f} {tg}")
    print(json.dumps({"benchmark": "thread_scaling", "model": str(gguf), "cpu": describe_cpu(),
                      "kernels": chosen_isa(), "cpus": os.cpu_count(), "env": waits,
                      "rows": rows}, sort_keys=True))


if __name__ == "__main__":
    main()
