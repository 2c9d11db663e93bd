"""Speed beside a busy neighbour: tokenmill (its thread governor on and off) and llama.cpp
(llama-bench), alone and while `--busy` other processes each keep a CPU busy (a Python loop),
same model file, same thread count. A shared machine is the common case on laptops and small
cloud VMs; threads that wait for each other at every parallel loop lose more than the CPU time
the neighbour takes (docs/performance.md, "Stop 58"). Per setting: decode tok/s (128 tokens
after a 128-token prompt), a 512-token prompt's tok/s, and for tokenmill 16 sequences' output
tok/s (64 tokens each). Prints a table and ends with one JSON line.

    python benchmarks/busy_neighbour.py [--model NAME] [--threads 2] [--busy 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import emit_json, machine, median, print_table  # noqa: E402
from benchmarks.compare_llamacpp import llama_bench  # noqa: E402


def spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def child(model: str, threads: int) -> dict:
    """tokenmill's three measures in this process (the parent sets TOKENMILL_ADAPT_THREADS)."""
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.loaders.resolve import resolve_model

    torch.set_num_threads(threads)
    llm = LLM(resolve_model(model), dtype="auto", max_num_seqs=16, enable_prefix_caching=False,
              max_model_len=1024, num_threads=threads)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size

    def ids(n):
        return {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}

    def gen(prompts, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate(prompts, sp, use_tqdm=False)

    gen(ids(64), 8)  # warm-up
    dec = gen(ids(128), 128)[0].metrics
    pre = [gen(ids(512), 1)[0].metrics.time_to_first_token for _ in range(2)]
    t = time.perf_counter()
    batch = gen([ids(64) for _ in range(16)], 64)
    return {"decode_tok_s": 1 / dec.mean_inter_token_latency,
            "prefill_tok_s": 512 / median(pre),
            "batch16_tok_s": sum(len(o.outputs[0].token_ids) for o in batch)
            / (time.perf_counter() - t)}


def run_child(model: str, threads: int, adapt: bool) -> dict:
    env = {**os.environ, "TOKENMILL_ADAPT_THREADS": "1" if adapt else "0"}
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--threads",
                          str(threads)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the engines")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.threads)))
        return
    from tokenmill.loaders.resolve import resolve_model

    gguf = Path(resolve_model(args.model))
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for cond in ("alone", "busy"):
            stop = mp.Event()
            spinners = [mp.Process(target=spin, args=(stop,)) for _ in range(
                args.busy if cond == "busy" else 0)]
            for p in spinners:
                p.start()
            time.sleep(0.5)
            for name, adapt in (("tokenmill", True), ("tokenmill, governor off", False)):
                runs.setdefault((name, cond), []).append(run_child(args.model, args.threads,
                                                                   adapt))
            if not args.no_llama_cpp:
                runs.setdefault(("llama.cpp", cond), []).append(
                    llama_bench(gguf, args.threads, 512, 128))
            stop.set()
            for p in spinners:
                p.join()
    keys = ("decode_tok_s", "prefill_tok_s", "batch16_tok_s")
    table = {f"{name}, {cond}": {k: median([r[k] for r in rs]) for k in keys if k in rs[0]}
             for (name, cond), rs in runs.items()}
    rows = []
    for (name, cond) in runs:
        row = {"engine": name, "neighbour": cond, **table[f"{name}, {cond}"]}
        alone = table[f"{name}, alone"]
        if cond == "busy":
            row["decode_kept"] = row["decode_tok_s"] / alone["decode_tok_s"]
            row["prefill_kept"] = row["prefill_tok_s"] / alone["prefill_tok_s"]
        rows.append(row)
    print_table(rows, ["engine", "neighbour", "decode_tok_s", "prefill_tok_s", "batch16_tok_s",
                       "decode_kept", "prefill_kept"])
    emit_json({"benchmark": "busy_neighbour", "model": args.model, "threads": args.threads,
               "busy_processes": args.busy, "rounds": args.rounds, "machine": machine(),
               "results": table})


if __name__ == "__main__":
    main()
