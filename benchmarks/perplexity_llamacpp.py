"""Perplexity of the same GGUF files on the same text, tokenmill against llama.cpp's
llama-perplexity: a check of the quantized formats (and the GGUF tokenizers) on real models,
where transformers has no counterpart for the files' quantized weights.

Both engines follow llama-perplexity's protocol: the text tokenized as llama.cpp does it (with
BOS where the file asks for one), cut into chunks of --ctx tokens (BOS as every chunk's first
token where the file adds one), each chunk evaluated alone, and the tokens of its second half
scored (positions ctx/2 + 1 .. ctx - 1). tokenmill runs each chunk as one prompt through its
paged cache, in a fresh process per file. The token ids of both tokenizers are compared too.
Defaults: the built-in models (the default Q4_1 / Q8_0 file, Gemma-3-270M Q4_K_M) on both texts
in benchmarks/data. Prints a table and ends with one JSON line.

    python benchmarks/perplexity_llamacpp.py [--models FILE_OR_NAME,...] [--ctx 512] [--threads 2]
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
from benchmarks.quant_formats import llama_bin  # noqa: E402

TEXTS = [ROOT / "benchmarks" / "data" / name for name in ("mill_essay.txt", "tokenmill_code.txt")]


def llama_tokens(bin_dir: Path, gguf: str, text: Path) -> list[int]:
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", gguf, "-f", str(text), "--ids",
                          "--log-disable"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_perplexity(bin_dir: Path, gguf: str, text: Path, ctx: int, threads: int) -> dict:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", gguf, "-f", str(text), "-c",
                          str(ctx), "-t", str(threads)], capture_output=True, text=True,
                         check=True)
    log = out.stdout + out.stderr
    running = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", log)]
    final = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1))
    return {"running": running, "ppl": final}


def tokenmill_perplexity(gguf: str, text: Path, ctx: int, threads: int) -> dict:
    """Run in a fresh process: the running perplexity after each chunk, as llama-perplexity
    prints it, and the token ids."""
    import torch

    from tokenmill import LLM

    torch.set_num_threads(threads)
    llm = LLM(gguf, max_num_seqs=1, enable_prefix_caching=False, max_model_len=ctx,
              num_threads=threads)
    tok = llm.engine.tokenizer
    ids = tok.encode(text.read_text())
    first, nll, count, running = ctx // 2, 0.0, 0, []
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if tok.add_bos_token:
            chunk[0] = tok.bos_token_id
        logits = llm.engine.compute_logits(chunk)[first:ctx - 1].double()
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
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a file and a text
    args = ap.parse_args()
    if args.one:
        print(json.dumps(tokenmill_perplexity(args.one[0], Path(args.one[1]), args.ctx,
                                              args.threads)))
        return
    from tokenmill.kernels.isa import describe_cpu
    from tokenmill.loaders.resolve import resolve_model

    bin_dir = llama_bin()
    rows = []
    print(f"{describe_cpu()}, {args.threads} threads; chunks of {args.ctx}, the second half "
          f"of each scored")
    print(f"{'file':<44}{'text':<20}{'same ids':>9}{'chunks':>7}{'llama.cpp':>10}"
          f"{'tokenmill':>10}{'diff':>8}{'worst running':>14}")
    for model in args.models.split(","):
        gguf = str(resolve_model(model))
        for text in TEXTS:
            theirs = llama_perplexity(bin_dir, gguf, text, args.ctx, args.threads)
            out = subprocess.run([sys.executable, __file__, "--one", gguf, str(text), "--ctx",
                                  str(args.ctx), "--threads", str(args.threads)],
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
                      "threads": args.threads, "ctx": args.ctx, "results": rows},
                     sort_keys=True))


if __name__ == "__main__":
    main()
