"""Quantized weights, tokenmill vs llama.cpp on the same files: the default Q4_1 file plus
Q8_0, Q4_0 and Q4_K_M made by llama-quantize from the BF16 GGUF (benchmarks/bf16_model.py).
Per format: bytes on disk, tokenmill's resident memory after loading (a fresh process, 64 MiB
KV budget), single-stream decode (128 + 128, as llama-bench -p 0 -n 128 -d 128) and prefill of
512 tokens for both engines in the same run, and tokenmill's perplexity on benchmarks/data
(chunks of 16, every chunk reading its history from the cache) next to the BF16 file's.
Prints a table and ends with one JSON line.

    python benchmarks/quant_formats.py [--threads 2] [--formats Q4_1,Q8_0,Q4_0,Q4_K_M]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bf16_model import DEFAULT_MODEL, bench_dir, bf16_gguf, model_stem  # noqa: E402
from benchmarks.compare_llamacpp import llama_bench  # noqa: E402

TEXT = ROOT / "benchmarks" / "data" / "mill_essay.txt"


def llama_bin() -> Path:
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_cpp.sh")],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def quantized_file(fmt: str, bf16: Path) -> Path:
    """The BF16 file in format fmt, made by llama-quantize once; the default model's own file
    for its Q4_1 (its BF16 file was made from it)."""
    if fmt == "Q4_1":
        from tokenmill.loaders.resolve import resolve_model

        own = Path(resolve_model(DEFAULT_MODEL))
        if model_stem(own) == model_stem(bf16):
            return own
    if fmt == "BF16":
        return bf16
    dst = bench_dir() / bf16.name.replace(".BF16.", f".{fmt}.")
    if not dst.exists():
        subprocess.run([str(llama_bin() / "llama-quantize"), str(bf16), str(dst), fmt],
                       capture_output=True, check=True)
    return dst


def measure_one(path: str, threads: int) -> dict:
    """Run in a fresh process: RSS growth of loading, decode, prefill, perplexity."""
    import random

    import psutil
    import torch

    from benchmarks.compare_llamacpp import tokenmill_bench
    from tokenmill import LLM
    from tokenmill.bench.offline import weight_bytes_per_token

    torch.set_num_threads(threads)
    proc = psutil.Process()
    before = proc.memory_info().rss
    llm = LLM(path, max_num_seqs=1, enable_prefix_caching=False, max_model_len=1024,
              kv_cache_memory=64 << 20, num_threads=threads)
    rss = proc.memory_info().rss - before
    rng = random.Random(0)
    tokenmill_bench(llm, 64, 8, rng)  # warm-up
    speed = tokenmill_bench(llm, 512, 128, rng)
    ids = llm.engine.tokenizer.encode(TEXT.read_text())[:1024]
    logits = llm.engine.compute_logits(ids, chunk_size=16)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    weights = weight_bytes_per_token(llm.engine.runner.model)
    return {**speed, "rss_mib": rss / 2**20, "perplexity": math.exp(nll.item()),
            "weight_mib_per_token": weights / 2**20,
            "decode_gb_s": speed["decode_tok_s"] * weights / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="BF16,Q4_1,Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.threads)))
        return
    from tokenmill.kernels.isa import describe_cpu

    bf16 = bf16_gguf()
    rows = {}
    for fmt in args.formats.split(","):
        path = quantized_file(fmt, bf16)
        out = subprocess.run([sys.executable, __file__, "--one", str(path), "--threads",
                              str(args.threads)], capture_output=True, text=True, check=True)
        ours = json.loads(out.stdout.strip().splitlines()[-1])
        try:
            theirs = llama_bench(path, args.threads, 512, 128)
        except subprocess.CalledProcessError as e:  # e.g. its weight repacking crashing
            theirs = {"error": (e.stderr or "")[-200:]}
        rows[fmt] = {"file_mib": path.stat().st_size / 2**20, "tokenmill": ours,
                     "llama.cpp": theirs}
    base = rows.get("BF16", {}).get("tokenmill", {}).get("perplexity")
    print(f"{describe_cpu()}, {args.threads} threads; decode = 128 tokens after a 128-token "
          f"prompt, prefill = 512 tokens; perplexity on {TEXT.name} (1,024 tokens)")
    print(f"{'format':<8}{'file MiB':>9}{'RSS MiB':>8}{'decode tm':>10}{'llama.cpp':>10}"
          f"{'ratio':>6}{'GB/s':>6}{'prefill tm':>11}{'llama.cpp':>10}{'ratio':>6}"
          f"{'ppl':>7}{'vs BF16':>8}")
    for fmt, r in rows.items():
        t, ll = r["tokenmill"], r["llama.cpp"]
        dl, pl = ll.get("decode_tok_s", float("nan")), ll.get("prefill_tok_s", float("nan"))
        delta = f"{100 * (t['perplexity'] / base - 1):+.1f}%" if base else "-"
        print(f"{fmt:<8}{r['file_mib']:>9.0f}{t['rss_mib']:>8.0f}{t['decode_tok_s']:>10.1f}"
              f"{dl:>10.1f}{t['decode_tok_s'] / dl:>6.2f}{t['decode_gb_s']:>6.1f}"
              f"{t['prefill_tok_s']:>11.0f}{pl:>10.0f}{t['prefill_tok_s'] / pl:>6.2f}"
              f"{t['perplexity']:>7.2f}{delta:>8}")
    print(json.dumps({"benchmark": "quant_formats", "cpu": describe_cpu(),
                      "threads": args.threads, "results": rows}, sort_keys=True))


if __name__ == "__main__":
    main()
