"""Tensor parallelism on one host, honestly small: TP=2 with one thread per rank against TP=1
with two threads, on a model whose heads split in two (Gemma-3-270M: 4 heads, 1 KV head).

For each setting: single-stream prefill (a 256-token prompt) and decode (64 tokens) speed, a
batch of 16 sequences x 64 tokens, and the share of rank 0's step time spent in all-reduces
(waiting for the other rank included). TP=2 runs with the shared-memory collectives and with
gloo's. Settings alternate over rounds; medians. Prints a table, ends with one JSON line.

    python benchmarks/tensor_parallel.py [--model gemma-3-270m] [--dtype auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit_json, machine, print_table  # noqa: E402

SETTINGS = {  # name: (tensor_parallel_size, threads per rank, collectives)
    "TP=1, 2 threads": (1, 2, None),
    "TP=2, 1 thread/rank, shm": (2, 1, "shm"),
    "TP=2, 1 thread/rank, gloo": (2, 1, "gloo"),
}


def run_requests(engine, prompts, max_tokens) -> float:
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(model: str, dtype: str, setting: tuple) -> dict:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    tp, threads, comm = setting
    if comm:
        os.environ["TOKENMILL_TP_COMM"] = comm
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, tensor_parallel_size=tp,
                                    num_threads=threads, max_model_len=2048, max_num_seqs=16))
    try:
        vocab = engine.model_config.vocab_size
        prompt = [(i * 7919) % vocab for i in range(256)]
        run_requests(engine, [prompt[:32]], 8)  # warm-up
        prefill = run_requests(engine, [prompt], 1)
        group = engine.tp.group if engine.tp else None
        reduce0 = group.reduce_seconds if group else 0.0
        decode = run_requests(engine, [prompt[:16]], 65) - run_requests(engine, [prompt[:16]], 1)
        reduce_s = (group.reduce_seconds - reduce0) if group else 0.0
        batch = [[(i * 31 + j) % vocab for j in range(64)] for i in range(16)]
        batch_s = run_requests(engine, batch, 64)
        return {"prefill_tok_s": 256 / prefill, "decode_tok_s": 64 / decode,
                "batch16_tok_s": 16 * 64 / batch_s,
                "allreduce_share": reduce_s / max(decode, 1e-9) if group else None}
    finally:
        engine.close()
        os.environ.pop("TOKENMILL_TP_COMM", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, setting in SETTINGS.items():
            runs[name].append(measure(args.model, args.dtype, setting))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    rows = []
    for name, results in runs.items():
        row = {"setting": name}
        for key in results[0]:
            values = [x[key] for x in results if x[key] is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["decode_vs_tp1"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["batch_vs_tp1"] = row["batch16_tok_s"] / base["batch16_tok_s"]
    print_table(rows, ["setting", "prefill_tok_s", "decode_tok_s", "batch16_tok_s",
                       "allreduce_share", "decode_vs_tp1", "batch_vs_tp1"])
    emit_json({"benchmark": "tensor_parallel", "machine": machine(), "model": args.model,
               "dtype": args.dtype, "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
