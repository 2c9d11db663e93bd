"""KV cache quality: perplexity of the default model on two fixed texts (benchmarks/data: our
own prose, and a frozen copy of two tokenmill source files as code) with each KV cache dtype,
every 16-token chunk reading its history from the cache; greedy agreement with the float32
cache over 256 generated tokens; bytes per token. The model runs in float32 so that only the
cache changes. With --ablation, also the int4 variants tried on the way to the final format
(simulated: values quantized and dequantized at store time, so only quality is measured).
Prints tables and ends with one JSON line.

    python benchmarks/kv_quality.py [--ablation]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TEXT = Path(__file__).with_name("data") / "mill_essay.txt"
CODE = Path(__file__).with_name("data") / "tokenmill_code.txt"
DTYPES = ["float32", "bfloat16", "fp8_e4m3", "int8", "int4"]


def perplexity(llm, ids: list[int], chunk: int = 16) -> float:
    """Scored in chunks, so every chunk after the first reads its history from the cache."""
    logits = llm.engine.compute_logits(ids, chunk_size=chunk)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def greedy(llm, prompt: list[int], n: int) -> list[int]:
    from tokenmill import SamplingParams

    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def teacher_forced(llm, prompt: list[int], reference: list[int]) -> float:
    """How often this cache picks the reference's next token, given the reference's history."""
    logits = llm.engine.compute_logits(prompt + reference, chunk_size=1)
    picks = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(picks, reference)) / len(reference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunk", type=int, default=16, help="scoring chunk (tokens)")
    ap.add_argument("--ablation", action="store_true", help="also the int4 variants tried")
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    from tokenmill import LLM

    rows, reference = [], None
    for kv in DTYPES:
        llm = LLM(args.model, dtype="float32", kv_cache_dtype=kv, max_num_seqs=1,
                  max_model_len=4096, enable_prefix_caching=False)
        ids = llm.tokenizer.encode(TEXT.read_text())
        prompt = ids[:64]
        tokens = greedy(llm, prompt, args.new_tokens)
        reference = reference or tokens
        same = sum(a == b for a, b in zip(tokens, reference))
        first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                     len(tokens))
        per_token = llm.engine.kv_plan.bytes_per_token
        code = llm.tokenizer.encode(CODE.read_text())[:2048]
        rows.append({"kv_dtype": kv, "perplexity": perplexity(llm, ids, args.chunk),
                     "perplexity_code": perplexity(llm, code, args.chunk),
                     "greedy_agreement": same / len(tokens), "first_divergence": first,
                     "teacher_forced_agreement": teacher_forced(llm, prompt, reference),
                     "bytes_per_token": per_token, "tokens_per_gib": int(2**30 // per_token)})
        print(f"{kv}: done", file=sys.stderr)
    base = rows[1]["tokens_per_gib"]  # relative to bfloat16
    print(f"{args.model}, float32 weights, {len(ids)}-token text ({TEXT.name}), greedy over "
          f"{args.new_tokens} tokens vs the float32 cache")
    print(f"{'kv dtype':<10}{'ppl prose':>10}{'ppl code':>10}{'greedy same':>13}{'1st diff':>9}"
          f"{'forced same':>13}{'bytes/tok':>11}{'tokens/GiB':>12}{'vs bf16':>9}")
    for r in rows:
        print(f"{r['kv_dtype']:<10}{r['perplexity']:>10.3f}{r['perplexity_code']:>10.3f}"
              f"{r['greedy_agreement']:>12.1%}"
              f"{r['first_divergence']:>9}{r['teacher_forced_agreement']:>12.1%}"
              f"{r['bytes_per_token']:>11,}{r['tokens_per_gib']:>12,}"
              f"{r['tokens_per_gib'] / base:>8.2f}x")
    ablation = run_ablation(args.model, rows[0]) if args.ablation else []
    print(json.dumps({"benchmark": "kv_quality", "model": args.model, "text_tokens": len(ids),
                      "rows": rows, "ablation": ablation}, sort_keys=True))


def named(fmt, name: str):
    fmt.name = name  # the engine looks formats up by name again
    return fmt


def run_ablation(model: str, base: dict) -> list[dict]:
    """Perplexity of each int4 variant tried, both texts, against the float32 cache."""
    import tokenmill.config
    from benchmarks.kv_variants import VARIANTS
    from tokenmill import LLM
    from tokenmill.layers import kv_quant

    out = []
    for name, (make, bytes_per_value) in VARIANTS.items():
        kv_quant.KV_FORMATS[name] = lambda make=make, name=name: named(make(), name)
        tokenmill.config.KV_CACHE_DTYPES = ("auto", *kv_quant.KV_FORMATS)
        llm = LLM(model, dtype="float32", kv_cache_dtype=name, max_num_seqs=1,
                  max_model_len=4096, enable_prefix_caching=False)
        prose = llm.tokenizer.encode(TEXT.read_text())
        code = llm.tokenizer.encode(CODE.read_text())[:2048]
        out.append({"variant": name, "bytes_per_value": bytes_per_value,
                    "perplexity": perplexity(llm, prose), "perplexity_code": perplexity(llm, code)})
        print(f"{name}: done", file=sys.stderr)
    print(f"\nint4 variants tried (head_dim 64; bytes per value include scales; vs float32 "
          f"{base['perplexity']:.3f} / {base['perplexity_code']:.3f})")
    print(f"{'variant':<34}{'bytes/value':>12}{'prose':>9}{'delta':>8}{'code':>8}{'delta':>8}")
    for r in out:
        dp = 100 * (r["perplexity"] / base["perplexity"] - 1)
        dc = 100 * (r["perplexity_code"] / base["perplexity_code"] - 1)
        print(f"{r['variant']:<34}{r['bytes_per_value']:>12.3f}{r['perplexity']:>9.3f}"
              f"{dp:>+7.1f}%{r['perplexity_code']:>8.3f}{dc:>+7.1f}%")
    return out


if __name__ == "__main__":
    main()
