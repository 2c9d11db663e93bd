"""Single-stream decode and prefill, tokenmill vs llama.cpp (llama-bench), same BF16 weights
(or with --file, the model file itself: its quantized weights in both engines), same thread
count, in alternating rounds (the machine's bandwidth drifts: only same-run ratios count).
Within a round each engine's pp is the mean of three prompts (llama-bench -r 3), its tg one
128-token run after a 128-token prompt.
Also measures this machine's limits (hw_limits.py) and reports each engine's achieved
GB/s and its share of the bandwidth limit, and its prefill's share of the FLOP limit (the
prompt's FLOPs: its matmuls and its causal attention's two products; also the matmuls
alone). The table's shares are against the best limit any round measured (conservative on a
host whose speed drifts); tokenmill's prefill is also given against each round's own limit,
measured just before its prompts. --depth N decodes after an N-token context instead of 128
(long-context decode: attention reads the whole history each token; llama-bench -d N).
Prints a table and ends with one JSON line.

    python benchmarks/compare_llamacpp.py [--model NAME] [--file] [--rounds 3] [--threads 2]
                                          [--depth 128]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import hw_limits  # noqa: E402
from benchmarks.bf16_model import bf16_gguf  # noqa: E402


def llama_bench(gguf: Path, threads: int, prompt: int, gen: int, depth: int = 128) -> dict:
    """pp<prompt> from an empty context; tg<gen> after a <depth>-token context, as tokenmill's
    decode is measured (a 128-token prompt, then 128 new tokens). llama.cpp's weight repacking
    has crashed on some machines (a segfault on a Q4_1 file on an AMX Xeon): a failed run is
    retried with --repack 0 and the result says so."""
    binary = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_cpp.sh")],
                            capture_output=True, text=True, check=True).stdout.strip()
    notes = []

    def run(*args: str) -> float:
        cmd = [f"{binary}/llama-bench", "-m", str(gguf), "-t", str(threads), "-r", "3", "-o",
               "json", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            notes.append(f"llama-bench {' '.join(args)} exited with {proc.returncode}; "
                         "retried with --repack 0")
            print(notes[-1])
            proc = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True,
                                  check=True)
        return json.loads(proc.stdout)[0]["avg_ts"]

    result = {"prefill_tok_s": run("-p", str(prompt), "-n", "0"),
              "decode_tok_s": run("-p", "0", "-n", str(gen), "-d", str(depth))}
    return {**result, "notes": notes} if notes else result


def tokenmill_bench(llm, prompt: int, gen: int, rng: random.Random, depth: int = 128) -> dict:
    from tokenmill import SamplingParams

    vocab = llm.engine.model_config.vocab_size

    def ids(n):
        return {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}

    # the mean of three prompts' rates, as llama-bench -r 3 averages its repetitions, after a
    # warm-up prompt as llama-bench runs one (the caches and threads right after llama-bench's
    # own run made a first prompt up to 30% slower)
    llm.generate(ids(prompt), SamplingParams(max_tokens=1), use_tqdm=False)
    pre = [llm.generate(ids(prompt), SamplingParams(max_tokens=1), use_tqdm=False)[0]
           for _ in range(3)]
    dec = llm.generate(ids(depth), SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True),
                       use_tqdm=False)[0]
    return {"prefill_tok_s": statistics.mean(prompt / o.metrics.time_to_first_token for o in pre),
            "decode_tok_s": 1.0 / dec.metrics.mean_inter_token_latency}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--depth", type=int, default=128, help="context before the decoded tokens")
    ap.add_argument("--file", action="store_true",
                    help="run the model file as it is (tokenmill dtype auto) instead of BF16")
    args = ap.parse_args()
    import torch

    from tokenmill import LLM
    from tokenmill.bench.offline import weight_bytes_per_token

    torch.set_num_threads(args.threads)
    if args.file:
        from tokenmill.loaders.resolve import resolve_model

        gguf, weights_kind = Path(resolve_model(args.model)), "file"
    else:
        gguf, weights_kind = bf16_gguf(args.model), "BF16"
    llm = LLM(str(gguf), dtype="auto" if args.file else "bfloat16", max_num_seqs=1,
              enable_prefix_caching=False,
              max_model_len=max(args.prompt, args.depth) + args.gen + 64,
              num_threads=args.threads)
    rng = random.Random(0)
    tokenmill_bench(llm, 64, 8, rng)  # warm-up
    runs = {"tokenmill": [], "llama.cpp": []}
    limits = []
    for _ in range(args.rounds):  # the limits just before tokenmill's prompts (see below)
        runs["llama.cpp"].append(llama_bench(gguf, args.threads, args.prompt, args.gen,
                                             args.depth))
        limits.append(hw_limits.measure())
        runs["tokenmill"].append(tokenmill_bench(llm, args.prompt, args.gen, rng, args.depth))
    # each limit the best any round measured ("cpu" as it is): the share of it is conservative
    lim = {k: (max(r[k] for r in limits) if isinstance(v, float) else v)
           for k, v in limits[0].items()}
    cfg = llm.engine.model_config
    # a decoded token reads the weights and, on average, depth + gen / 2 positions of 16-bit K
    # and V (tokenmill's bf16 cache, llama.cpp's f16)
    kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
                * (args.depth + args.gen // 2))
    weights = weight_bytes_per_token(llm.engine.runner.model) + kv_bytes
    matmul_params = sum(p.numel() for n, p in llm.engine.runner.model.named_parameters()
                        if "proj" in n)
    decode_limit = hw_limits.decode_limit_tok_s(lim, weights)
    shape = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim)
    # the share of the FLOP limit counts the prompt's attention products too (4% of its FLOPs
    # at 256 tokens, 8% at 512 for this model); matmuls_pct: the layers' matmuls alone
    prefill_limit = hw_limits.prefill_limit_tok_s(
        lim, hw_limits.prefill_flops(matmul_params, args.prompt, *shape), args.prompt)
    matmul_limit = hw_limits.prefill_limit_tok_s(
        lim, hw_limits.prefill_flops(matmul_params, args.prompt), args.prompt)
    # the host's speed drifts within a run: each round's prompts also against the limit
    # measured just before them (the table's share is against the best of any round)
    flops = hw_limits.prefill_flops(matmul_params, args.prompt, *shape)
    round_pct = [100 * r["prefill_tok_s"] / hw_limits.prefill_limit_tok_s(li, flops, args.prompt)
                 for r, li in zip(runs["tokenmill"], limits)]
    table = {}
    for name, rs in runs.items():
        row = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "notes"}
        row["decode_gb_s"] = row["decode_tok_s"] * weights / 1e9
        row["decode_pct_of_limit"] = 100 * row["decode_tok_s"] / decode_limit
        row["prefill_pct_of_limit"] = 100 * row["prefill_tok_s"] / prefill_limit
        row["prefill_matmuls_pct_of_limit"] = 100 * row["prefill_tok_s"] / matmul_limit
        table[name] = row
    ratios = {k: table["tokenmill"][k] / table["llama.cpp"][k]
              for k in ("decode_tok_s", "prefill_tok_s")}
    print(f"{args.model} {weights_kind} weights, {args.threads} threads, decode after "
          f"{args.depth} tokens, median of "
          f"{args.rounds} alternating rounds; read bandwidth {lim['read_gb_s']:.1f} GB/s, "
          f"fp32 matmul {lim['fp32_gflop_s']:.0f} GFLOP/s")
    print(f"limits: decode {decode_limit:.1f} tok/s ({weights / 2**20:.0f} MiB/token), "
          f"prefill {prefill_limit:.0f} tok/s ({matmul_limit:.0f} counting the matmuls only)")
    print(f"{'engine':<11}{'tg' + str(args.gen) + ' tok/s':>13}{'GB/s':>7}{'% BW limit':>11}"
          f"{'pp' + str(args.prompt) + ' tok/s':>14}{'% FLOP limit':>13}{'(matmuls)':>10}")
    for name, r in table.items():
        print(f"{name:<11}{r['decode_tok_s']:>13.1f}{r['decode_gb_s']:>7.1f}"
              f"{r['decode_pct_of_limit']:>10.0f}%{r['prefill_tok_s']:>14.0f}"
              f"{r['prefill_pct_of_limit']:>12.0f}%{r['prefill_matmuls_pct_of_limit']:>9.0f}%")
    print(f"tokenmill / llama.cpp: decode {ratios['decode_tok_s']:.2f}x, "
          f"prefill {ratios['prefill_tok_s']:.2f}x")
    print("tokenmill's prefill against each round's own limit: "
          + ", ".join(f"{p:.0f}% ({max(li['fp32_gflop_s'], li['bf16_gflop_s']):.0f} GFLOP/s)"
                      for p, li in zip(round_pct, limits))
          + f"; median {statistics.median(round_pct):.0f}%")
    print(json.dumps({"benchmark": "compare_llamacpp", "model": args.model,
                      "weights": weights_kind, "depth": args.depth, "limits": lim,
                      "decode_limit_tok_s": decode_limit, "prefill_limit_tok_s": prefill_limit,
                      "prefill_matmuls_limit_tok_s": matmul_limit,
                      "results": table, "ratios": ratios, "rounds": runs,
                      "round_limits": limits, "round_prefill_pct_of_limit": round_pct},
                     sort_keys=True))


if __name__ == "__main__":
    main()
