"""Long-context serving by KV cache dtype: `tokenmill serve` (default model) with the same KV
budget in bytes for every dtype, small enough that a bf16 cache cannot hold 16 sequences of
3,000-token prompts and preempts; `tokenmill bench serve` with 16 clients, 32 requests of
~3,000 prompt / 128 output tokens (ignore_eos). A smaller cache format holds more sequences
in the same bytes. Prints output tok/s, TTFT, preemptions and the sequences each budget
holds; then the capacity table: for budgets of 450 MiB, 1 GiB and 4 GiB, the tokens and the
4,096-token sequences the engine's own plan holds per dtype (its blocks after int4's stage),
against bf16. Ends with one JSON line.

    python benchmarks/kv_serving.py [--dtypes bfloat16,int8,int4] [--kv-budget 450MiB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.serve_compare import child_env, free_port, stop, wait_healthy  # noqa: E402


def preemptions(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tokenmill:num_preemptions"):
            return int(float(line.split()[-1]))
    raise RuntimeError("no tokenmill:num_preemptions metric")


def serve_run(args, kv: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", str(port),
           "--kv-cache-dtype", kv, "--kv-cache-memory", args.kv_budget,
           "--max-num-seqs", str(args.concurrency),
           "--max-model-len", str(args.input_len + args.output_len + 200),
           "--threads", str(args.threads)]
    env = child_env()
    log = tempfile.NamedTemporaryFile("w+", suffix=f"-{kv}.log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(url, proc)
        out = Path(tempfile.mkdtemp()) / "result.json"
        subprocess.run([sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", url,
                        "--num-prompts", str(args.num_prompts), "--max-concurrency",
                        str(args.concurrency), "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--save-result", str(out),
                        "--disable-tqdm"], check=True, env=env, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        result = {k: v for k, v in json.loads(out.read_text()).items()
                  if not isinstance(v, list)}  # the summary, not every request's timings
        result["num_preemptions"] = preemptions(url)
        log.seek(0)
        plan = [line.strip() for line in log if "KV cache" in line or "kv cache" in line]
        result["plan"] = plan[-1] if plan else ""
        return result
    finally:
        stop(proc)


def capacity(model: str, dtypes: list[str], budgets=(450 * 2**20, 2**30, 4 * 2**30),
             context: int = 4096) -> list[dict]:
    """Per budget and dtype, what the engine's KV plan holds (blocks after the stage), for the
    model in bfloat16 (how the default model runs with the kernels)."""
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.cache_config import plan_kv_cache
    from tokenmill.loaders.resolve import read_model_config, resolve_model

    mc = read_model_config(resolve_model(model))
    rows = []
    for budget in budgets:
        for kv in dtypes:
            config = EngineConfig(model=model, kv_cache_dtype=kv, kv_cache_memory=budget,
                                  max_model_len=context, max_num_seqs=16)
            plan = plan_kv_cache(config, mc, torch.bfloat16, torch.device("cpu"))
            rows.append({"budget": budget, "kv_dtype": kv, "block_size": plan.block_size,
                         "bytes_per_token": plan.bytes_per_token, "tokens": plan.num_tokens,
                         "sequences": plan.num_tokens // context,
                         "stage_bytes": sum(g.stage_slots * g.stage_bytes for g in plan.groups)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,int8,int4")
    ap.add_argument("--kv-budget", default="450MiB", help="the same for every dtype")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=3000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--capacity-only", action="store_true", help="the capacity table only")
    args = ap.parse_args()
    from tokenmill.kernels.isa import describe_cpu

    rows = {}
    for kv in args.dtypes.split(",") if not args.capacity_only else []:
        rows[kv] = serve_run(args, kv)
        print(f"{kv}: done", file=sys.stderr)
    base = rows.get("bfloat16")
    print(f"{describe_cpu()}, {args.threads} threads, {args.model}, KV budget {args.kv_budget}, "
          f"{args.concurrency} clients, {args.num_prompts} x ~{args.input_len}/{args.output_len}")
    print(f"{'kv dtype':<10}{'out tok/s':>10}{'vs bf16':>9}{'median TTFT ms':>16}"
          f"{'median ITL ms':>15}{'preemptions':>13}")
    for kv, r in rows.items():
        ratio = r["output_throughput"] / base["output_throughput"] if base else float("nan")
        print(f"{kv:<10}{r['output_throughput']:>10.1f}{ratio:>8.2f}x{r['median_ttft_ms']:>16.0f}"
              f"{r['median_itl_ms']:>15.1f}{r['num_preemptions']:>13}")
    for kv, r in rows.items():
        print(f"  {kv}: {r['plan']}")
    held = capacity(args.model, args.dtypes.split(","))
    print(f"\ncapacity ({args.model} in bf16, max_num_seqs 16): 4,096-token sequences held")
    print(f"{'budget':>8}{'kv dtype':>10}{'block':>6}{'bytes/tok':>11}{'stage MiB':>10}"
          f"{'tokens':>10}{'seqs':>6}{'vs bf16':>9}")
    for r in held:
        bf16 = next(b for b in held if b["budget"] == r["budget"]
                    and b["kv_dtype"] == "bfloat16")
        print(f"{r['budget'] / 2**20:>7.0f}M{r['kv_dtype']:>10}{r['block_size']:>6}"
              f"{r['bytes_per_token']:>11,}{r['stage_bytes'] / 2**20:>10.1f}{r['tokens']:>10,}"
              f"{r['sequences']:>6}{r['tokens'] / bf16['tokens']:>8.2f}x")
    print(json.dumps({"benchmark": "kv_serving", "cpu": describe_cpu(), "threads": args.threads,
                      "kv_budget": args.kv_budget, "results": rows, "capacity": held},
                     sort_keys=True, default=str))


if __name__ == "__main__":
    main()
