"""Start-up time: a fresh Python process from its first line to the first generated token
(warm: kernels compiled, model in the cache, files in the page cache), with the breakdown
(imports, then the engine's phases: metadata, kernel library, weights, tokenizer, KV cache,
packing, then the first token), and the time `tokenmill serve` takes to answer /health.

    python benchmarks/startup.py [--model smollm2-135m-instruct] [--runs 3]
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.serve_compare import free_port  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from tokenmill import LLM, SamplingParams
import tokenmill.llm
t2 = time.perf_counter()
llm = LLM(sys.argv[1])  # the defaults `tokenmill generate` uses
t3 = time.perf_counter()
llm.generate("What is the capital of France?", SamplingParams(max_tokens=1, temperature=0),
             use_tqdm=False)
t4 = time.perf_counter()
print(json.dumps({"import torch": t1 - t0, "import tokenmill": t2 - t1,
                  **llm.engine.startup.phases, "engine other": t3 - t2 - llm.engine.startup.total,
                  "first token": t4 - t3, "total": t4 - t0}))
"""


def one_start(model: str) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - start  # interpreter start and exit included
    return result


def serve_start(model: str) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", model, "--port",
                             str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"tokenmill serve exited with {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from tokenmill.kernels.isa import describe_cpu

    one_start(args.model)  # warm-up: builds kernels, pulls the model, fills the page cache
    runs = [one_start(args.model) for _ in range(args.runs)]
    phases = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    serve = statistics.median(serve_start(args.model) for _ in range(args.runs))
    print(f"warm start of {args.model} on {describe_cpu()}, median of {args.runs} runs")
    for name, sec in phases.items():
        print(f"  {name:<18} {sec:7.3f} s")
    print(f"  {'serve /health':<18} {serve:7.3f} s")
    print(json.dumps({"benchmark": "startup", "model": args.model, "cpu": describe_cpu(),
                      "phases_s": phases, "serve_healthy_s": serve, "runs": runs},
                     sort_keys=True))


if __name__ == "__main__":
    main()
