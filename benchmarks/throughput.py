"""Offline throughput: N random requests (random prompt/output lengths, fixed seed, ignore_eos)
through tokenmill's continuous batching and through transformers' generate() on the same
weights, in the same run. Prints a table and ends with one JSON line.

transformers cannot stop each sequence at its own length inside a batch, so it runs batches of
--hf-batch requests left-padded, generating the batch's longest output; only the requested
tokens count as output (the same useful work tokenmill does).

    python benchmarks/throughput.py --model smollm2-135m-instruct --num-prompts 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    emit_json,
    load_hf,
    machine,
    print_table,
    random_workload,
    resolve,
)


def run_tokenmill(llm, work) -> dict:
    from tokenmill import SamplingParams

    llm.generate({"prompt_token_ids": work[0][0][:8]}, SamplingParams(max_tokens=4),
                 use_tqdm=False)  # warm-up
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in work)
    return {"engine": "tokenmill", "seconds": elapsed, "output_tokens": tokens,
            "output_tok_s": tokens / elapsed,
            "total_tok_s": (tokens + sum(len(p) for p, _ in work)) / elapsed}


@torch.inference_mode()
def run_hf(path, work, args) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        "float32" if args.dtype == "auto" else args.dtype]
    model = load_hf(path, dtype)
    pad = 0
    model.generate(torch.tensor([work[0][0][:8]]), max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    for i in range(0, len(work), args.hf_batch):
        batch = work[i : i + args.hf_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch),
                       min_new_tokens=max(n for _, n in batch), do_sample=False,
                       pad_token_id=pad)
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in work)
    return {"engine": "transformers", "seconds": elapsed, "output_tokens": tokens,
            "output_tok_s": tokens / elapsed,
            "total_tok_s": (tokens + sum(len(p) for p, _ in work)) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    from tokenmill import LLM

    path = resolve(args.model)
    llm = LLM(path, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    work = random_workload(args.num_prompts, vocab, args.prompt_len, args.output_len, args.seed)
    rows = [run_tokenmill(llm, work)]
    del llm
    if not args.skip_hf:
        rows.append(run_hf(path, work, args))
    print(f"\n{args.num_prompts} requests, prompt {args.prompt_len}, output {args.output_len}, "
          f"dtype {args.dtype}, {machine()}")
    print_table(rows, ["engine", "seconds", "output_tokens", "output_tok_s", "total_tok_s"])
    result = {"benchmark": "throughput", "model": args.model, "num_prompts": args.num_prompts,
              "dtype": args.dtype, "results": rows, **machine()}
    if len(rows) == 2:
        result["speedup_vs_transformers"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
        print(f"tokenmill / transformers output tok/s: {result['speedup_vs_transformers']:.2f}x")
    emit_json(result)


if __name__ == "__main__":
    main()
