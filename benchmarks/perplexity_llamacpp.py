"""Perplexity of the same GGUF files on the same text, tokenmill against llama.cpp's
llama-perplexity: a check of the quantized formats (and the GGUF tokenizers) on real models,
where transformers has no counterpart for the files' quantized weights.

Both engines follow llama-perplexity's protocol: the text tokenized as llama.cpp does it (with
BOS where the file asks for one), cut into chunks of --ctx tokens (BOS as every chunk's first
token where the file adds one), each chunk evaluated alone, and the tokens of its second half
scored (positions ctx/2 + 1 .. ctx - 1). tokenmill runs each chunk as one prompt through its
paged cache, in a fresh process per file (--chunk N: in prompt chunks of N tokens, each
reading the chunks before it from the cache). The token ids of both tokenizers are compared
too. --kv-cache-dtype compares the quantized KV caches: tokenmill's int8 / int4 against
llama.cpp's q8_0 / q4_0 cache (flash attention on, as llama.cpp requires for a quantized V);
fp8_e4m3 has no llama.cpp counterpart and is set against its float16 cache. Defaults: the
built-in models (the default Q4_1 / Q8_0 file, Gemma-3-270M Q4_K_M) on both texts in
benchmarks/data. Prints a table and ends with one JSON line.

    python benchmarks/perplexity_llamacpp.py [--models FILE_OR_NAME,...] [--ctx 512]
        [--threads 2] [--kv-cache-dtype auto|int8|int4|fp8_e4m3] [--chunk N]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.kv_quality import CODE, TEXT  # noqa: E402
from benchmarks.quant_formats import llama_bin  # noqa: E402

LLAMA_KV = {"int8": "q8_0", "int4": "q4_0"}  # tokenmill's KV dtype -> llama.cpp's cache type
TEXTS = [TEXT, CODE]  # kv_quality.py's prose and code


def llama_tokens(bin_dir: Path, gguf: str, text: Path) -> list[int]:
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", gguf, "-f", str(text), "--ids",
                          "--log-disable"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_perplexity(bin_dir: Path, gguf: str, text: Path, ctx: int, threads: int,
                     kv: str = "auto") -> dict:
    cache = ["-fa", "on", "-ctk", LLAMA_KV[kv], "-ctv", LLAMA_KV[kv]] if kv in LLAMA_KV else []
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", gguf, "-f", str(text), "-c",
                          str(ctx), "-t", str(threads), *cache], capture_output=True, text=True,
                         check=True)
    log = out.stdout + out.stderr
    running = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", log)]
    final = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1))
    return {"running": running, "ppl": final}


def tokenmill_perplexity(gguf: str, text: Path, ctx: int, threads: int, kv: str = "auto",
                         prompt_chunk: int | None = None) -> dict:
    """Run in a fresh process: the running perplexity after each chunk, as llama-perplexity
    prints it, and the token ids."""
    import torch

    from tokenmill import LLM

    torch.set_num_threads(threads)
    llm = LLM(gguf, max_num_seqs=1, enable_prefix_caching=False, max_model_len=ctx,
              num_threads=threads, kv_cache_dtype=kv)
    tok = llm.engine.tokenizer
    ids = tok.encode(text.read_text())
    first, nll, count, running = ctx // 2, 0.0, 0, []
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if tok.add_bos_token:
            chunk[0] = tok.bos_token_id
        logits = llm.engine.compute_logits(chunk, chunk_size=prompt_chunk)[first:ctx - 1].double()
        targets = torch.tensor(chunk[first + 1:ctx])
        nll -= float(logits.log_softmax(-1).gather(1, targets[:, None]).sum())
        count += len(targets)
        running.append(math.exp(nll / count))
    return {"running": running, "ppl": running[-1], "ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "int4",
                                                                  "fp8_e4m3"])
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a file and a text
    args = ap.parse_args()
    if args.one:
        print(json.dumps(tokenmill_perplexity(args.one[0], Path(args.one[1]), args.ctx,
                                              args.threads, args.kv_cache_dtype, args.chunk)))
        return
    from tokenmill.kernels.isa import describe_cpu
    from tokenmill.loaders.resolve import resolve_model

    bin_dir = llama_bin()
    rows = []
    kv = args.kv_cache_dtype
    print(f"{describe_cpu()}, {args.threads} threads; chunks of {args.ctx}, the second half "
          f"of each scored; KV cache: tokenmill {kv}, llama.cpp {LLAMA_KV.get(kv, 'f16')}"
          f"{f'; tokenmill in prompt chunks of {args.chunk}' if args.chunk else ''}")
    print(f"{'file':<44}{'text':<20}{'same ids':>9}{'chunks':>7}{'llama.cpp':>10}"
          f"{'tokenmill':>10}{'diff':>8}{'worst running':>14}")
    for model in args.models.split(","):
        gguf = str(resolve_model(model))
        for text in TEXTS:
            theirs = llama_perplexity(bin_dir, gguf, text, args.ctx, args.threads, kv)
            extra = ["--chunk", str(args.chunk)] if args.chunk else []
            out = subprocess.run([sys.executable, __file__, "--one", gguf, str(text), "--ctx",
                                  str(args.ctx), "--threads", str(args.threads),
                                  "--kv-cache-dtype", kv, *extra],
                                 capture_output=True, text=True, check=True)
            ours = json.loads(out.stdout.strip().splitlines()[-1])
            same = ours.pop("ids") == llama_tokens(bin_dir, gguf, text)
            # the running estimate after each chunk: its worst relative gap
            worst = max(abs(a / b - 1) for a, b in zip(ours["running"], theirs["running"]))
            rows.append({"file": Path(gguf).name, "text": text.name, "same_ids": same,
                         "tokenmill": ours, "llama.cpp": theirs, "worst_running_gap": worst})
            print(f"{Path(gguf).name:<44}{text.name:<20}{str(same):>9}"
                  f"{len(theirs['running']):>7}{theirs['ppl']:>10.3f}{ours['ppl']:>10.3f}"
                  f"{100 * (ours['ppl'] / theirs['ppl'] - 1):>+7.2f}%{100 * worst:>13.2f}%")
    print(json.dumps({"benchmark": "perplexity_llamacpp", "cpu": describe_cpu(),
                      "threads": args.threads, "ctx": args.ctx, "kv_cache_dtype": kv,
                      "llama_cpp_kv": LLAMA_KV.get(kv, "f16"), "chunk": args.chunk,
                      "results": rows},
                     sort_keys=True))


if __name__ == "__main__":
    main()
