"""KV cache ablation, the seed articles' central picture: the cost of generating token t with
the KV cache (one decode step: reads the cached K/V of t-1 positions) versus without it
(recompute the whole prefix: a prefill of t positions for every new token).

With the cache, every one of the N tokens is timed. Without it, per-token cost is timed at
sampled positions (every --stride tokens) and the cumulative cost is integrated between them
(a full no-cache run of 1024 tokens would take ~10 minutes here); at each sample the recomputed
argmax is checked against the cached run's token. Saves a PNG of both curves and prints the
speed-up at 256/512/1024 tokens; ends with one JSON line.

    python benchmarks/kv_cache_ablation.py --tokens 1024 --plot docs/kv_cache_ablation.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def with_cache(llm, prompt: list[int], n: int):
    from tokenmill import SamplingParams

    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    times = [m.first_token_time - m.arrival_time] + m.inter_token_latencies
    return out.outputs[0].token_ids, times


def without_cache(llm, prompt: list[int], tokens: list[int], positions: list[int]):
    """Seconds to produce token i by recomputing all len(prompt)+i positions."""
    cost, agree = {}, 0
    for i in positions:
        ids = prompt + tokens[:i]
        start = time.perf_counter()
        logits = llm.engine.compute_logits(ids)
        cost[i] = time.perf_counter() - start
        agree += int(logits[-1].argmax().item() == tokens[i])
    return cost, agree


def integrate(samples: dict[int, float], n: int) -> list[float]:
    """Cumulative cost for 1..n tokens, linear between sampled positions."""
    xs = sorted(samples)
    per_token, j = [], 0
    for i in range(n):
        while j + 1 < len(xs) and xs[j + 1] <= i:
            j += 1
        if j + 1 < len(xs) and xs[j] <= i:
            a, b = xs[j], xs[j + 1]
            per_token.append(samples[a] + (samples[b] - samples[a]) * (i - a) / (b - a))
        else:
            per_token.append(samples[xs[j]])
    total, out = 0.0, []
    for c in per_token:
        total += c
        out.append(total)
    return out


def plot(path: str, n: int, prompt_len: int, cached, sampled, cum_cached, cum_nocache) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([prompt_len + i for i in range(n)], [t * 1e3 for t in cached], lw=0.8,
           label="with KV cache (decode step)")
    xs = sorted(sampled)
    a.plot([prompt_len + i for i in xs], [sampled[i] * 1e3 for i in xs], "o-", ms=3,
           label="without cache (recompute prefix)")
    a.set(xlabel="position of the generated token", ylabel="ms per token", yscale="log",
          title="Cost of one token")
    b.plot(range(1, n + 1), cum_cached, label="with KV cache")
    b.plot(range(1, n + 1), cum_nocache, label="without cache")
    b.set(xlabel="tokens generated", ylabel="seconds", title="Cumulative cost")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--stride", type=int, default=64)
    ap.add_argument("--plot", default="docs/kv_cache_ablation.png")
    args = ap.parse_args()
    from tokenmill import LLM

    n = args.tokens
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1,
              max_model_len=args.prompt_len + n + 16, enable_prefix_caching=False)
    prompt = list(range(1000, 1000 + args.prompt_len))
    with_cache(llm, prompt, 8)  # warm-up
    tokens, cached = with_cache(llm, prompt, n)
    positions = sorted(set(range(0, n, args.stride)) | {n - 1})
    sampled, agree = without_cache(llm, prompt, tokens, positions)
    cum_c, total = [], 0.0
    for t in cached:
        total += t
        cum_c.append(total)
    cum_n = integrate(sampled, n)
    print(f"{args.model} {args.dtype}, prompt {args.prompt_len} tokens; no-cache argmax matched "
          f"the cached run at {agree}/{len(positions)} sampled positions")
    print(f"{'tokens':>7} {'cached total s':>15} {'no-cache total s':>17} {'speed-up':>9} "
          f"{'ms/token cached':>16} {'ms/token no-cache':>18}")
    marks = {}
    for mark in (256, 512, 1024):
        if mark <= n:
            i = mark - 1
            near = min(sampled, key=lambda p: abs(p - i))
            marks[mark] = {"cached_s": cum_c[i], "nocache_s": cum_n[i],
                           "speedup": cum_n[i] / cum_c[i],
                           "cached_ms_per_token": cached[i] * 1e3,
                           "nocache_ms_per_token": sampled[near] * 1e3}
            r = marks[mark]
            print(f"{mark:>7} {r['cached_s']:>15.2f} {r['nocache_s']:>17.2f} "
                  f"{r['speedup']:>8.1f}x {r['cached_ms_per_token']:>16.2f} "
                  f"{r['nocache_ms_per_token']:>18.1f}")
    plot(args.plot, n, args.prompt_len, cached, sampled, cum_c, cum_n)
    print(f"plot saved to {args.plot}")
    print(json.dumps({"benchmark": "kv_cache_ablation", "model": args.model,
                      "dtype": args.dtype, "tokens": n, "argmax_agreement":
                      agree / len(positions), "marks": marks}, sort_keys=True))


if __name__ == "__main__":
    main()
