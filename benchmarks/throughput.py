"""Offline throughput: N random requests (random prompt/output lengths, fixed seed, ignore_eos)
through tokenmill's continuous batching and through transformers' generate() on the same
weights (the default model as a BF16 GGUF), in the same run. Prints a table and ends with one
JSON line.

transformers cannot stop each sequence at its own length inside a batch, so it runs batches of
--hf-batch requests, left-padded, generating the batch's longest output; only the requested
tokens count as output (the same useful work tokenmill does). transformers runs at its best
setting for the machine: bfloat16 or float32, whichever PyTorch multiplies faster here (bf16
is ~100x slower than float32 without AVX512-BF16 or AMX, faster with them); tokenmill runs bf16
(and float32 with --tokenmill-fp32).

The default workload is nano-vllm's (256 requests, 100-1024 tokens in and out) scaled to a
2-core CPU: 64 requests, prompts 100-512, outputs 100-256.

    python benchmarks/throughput.py [--num-prompts 64] [--skip-hf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bf16_model import bf16_gguf  # noqa: E402
from benchmarks.common import (  # noqa: E402
    best_matmul_dtype,
    emit_json,
    load_hf,
    machine,
    print_table,
    random_workload,
)


def run_tokenmill(path: str, dtype: str, work, args) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              max_model_len=max(len(p) + n for p, n in work) + 16)
    llm.generate({"prompt_token_ids": work[0][0][:8]}, SamplingParams(max_tokens=4),
                 use_tqdm=False)  # warm-up
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in work)
    return _row(f"tokenmill {dtype}", elapsed, work)


@torch.inference_mode()
def run_hf(path: str, work, args) -> dict:
    dtype = best_matmul_dtype() if args.hf_dtype == "auto" else getattr(torch, args.hf_dtype)
    args.hf_dtype = str(dtype).replace("torch.", "")
    model = load_hf(path, dtype)
    pad = 0
    model.generate(torch.tensor([work[0][0][:8]]), max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    for i in range(0, len(work), args.hf_batch):
        batch = work[i : i + args.hf_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=pad)
    return _row(f"transformers {args.hf_dtype}", time.perf_counter() - start, work)


def _row(engine: str, elapsed: float, work) -> dict:
    out_tokens = sum(n for _, n in work)
    in_tokens = sum(len(p) for p, _ in work)
    return {"engine": engine, "seconds": elapsed, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed,
            "total_tok_s": (out_tokens + in_tokens) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[100, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 256])
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--tokenmill-fp32", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    path = str(bf16_gguf(args.model))
    work = random_workload(args.num_prompts, 49152, args.prompt_len, args.output_len, args.seed)
    rows = [run_tokenmill(path, "bfloat16", work, args)]
    if args.tokenmill_fp32:
        rows.append(run_tokenmill(path, "float32", work, args))
    if not args.skip_hf:
        rows.append(run_hf(path, work, args))
    print(f"\n{args.num_prompts} requests, prompt {args.prompt_len}, output {args.output_len}, "
          f"{machine()}")
    print_table(rows, ["engine", "seconds", "output_tokens", "output_tok_s", "total_tok_s"])
    result = {"benchmark": "throughput", "model": args.model, "num_prompts": args.num_prompts,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "results": rows,
              **machine()}
    if not args.skip_hf:
        result["speedup_vs_transformers"] = rows[0]["output_tok_s"] / rows[-1]["output_tok_s"]
        print(f"tokenmill / transformers output tok/s: {result['speedup_vs_transformers']:.2f}x")
    emit_json(result)


if __name__ == "__main__":
    main()
