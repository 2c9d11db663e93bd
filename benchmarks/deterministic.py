"""What batch-invariant mode (`deterministic=True`) buys and costs, on a real model in bf16.

Buys: 8 chat prompts answered greedily alone, then all in one batch, then again from the
prefix cache; counts the prompts whose tokens or logprobs differ from the lone run, for the
default kernels and for the batch-invariant ones. Costs: single-stream prefill (pp512) and
decode (tg128 after 128 tokens) and a batched run (16 prompts x 64 tokens), both modes in
alternating rounds. Prints a table and ends with one JSON line.

    python benchmarks/deterministic.py [--model smollm2-135m-instruct] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.",
             "Explain photosynthesis in two sentences.", "List three prime numbers.",
             "What does a compiler do?", "Name a famous painter.",
             "How many legs does a spider have?", "Translate 'good morning' into Spanish."]


def answers(llm, prompts, one_by_one: bool):
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    outs = ([llm.generate(p, params, use_tqdm=False)[0] for p in prompts] if one_by_one
            else llm.generate(prompts, params, use_tqdm=False))
    return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def invariance(model: str, deterministic: bool) -> dict:
    from tokenmill import LLM

    kw = dict(dtype="bfloat16", deterministic=deterministic, max_num_seqs=8, max_model_len=1024)
    alone_llm = LLM(model, enable_prefix_caching=False, **kw)
    prompts = [alone_llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    alone = answers(alone_llm, prompts, True)
    llm = LLM(model, **kw)
    batched = answers(llm, prompts, False)
    cached = answers(llm, prompts, False)
    diff = {name: sum(a != b for a, b in zip(alone, r)) for name, r in
            (("batched", batched), ("prefix_cached", cached))}
    tokens = {name: sum(a[0] != b[0] for a, b in zip(alone, r)) for name, r in
              (("batched", batched), ("prefix_cached", cached))}
    return {"logprobs_differ": diff, "tokens_differ": tokens}


def speed(llm, rng: random.Random) -> dict:
    from tokenmill import SamplingParams

    vocab = llm.engine.model_config.vocab_size

    def ids(n):
        return {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}

    pre = llm.generate(ids(512), SamplingParams(max_tokens=1), use_tqdm=False)[0]
    dec = llm.generate(ids(128), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                       use_tqdm=False)[0]
    batch = [ids(rng.randrange(32, 256)) for _ in range(16)]
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"prefill_tok_s": 512 / pre.metrics.time_to_first_token,
            "decode_tok_s": 1 / dec.metrics.mean_inter_token_latency,
            "batch16_out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from tokenmill import LLM
    from tokenmill.kernels.isa import describe_cpu

    torch.set_num_threads(args.threads)
    result = {"benchmark": "deterministic", "model": args.model, "cpu": describe_cpu(),
              "invariance": {m: invariance(args.model, m == "deterministic")
                             for m in ("default", "deterministic")}}
    engines = {m: LLM(args.model, dtype="bfloat16", deterministic=m == "deterministic",
                      max_num_seqs=16, max_model_len=1024, enable_prefix_caching=False)
               for m in ("default", "deterministic")}
    rng = random.Random(0)
    for llm in engines.values():
        speed(llm, rng)  # warm-up
    rounds = {m: [] for m in engines}
    for _ in range(args.rounds):
        for m, llm in engines.items():
            rounds[m].append(speed(llm, rng))
    table = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
             for m, rs in rounds.items()}
    result.update(results=table, rounds=rounds, ratios={
        k: table["deterministic"][k] / table["default"][k] for k in table["default"]})
    print(f"{args.model} in bf16, {args.threads} threads, {result['cpu']}")
    print(f"{'mode':<14}{'prompts differing from alone (batched / cached)':>50}")
    for m, inv in result["invariance"].items():
        d, t = inv["logprobs_differ"], inv["tokens_differ"]
        print(f"{m:<14}{'logprobs ' + str(d['batched']) + ' / ' + str(d['prefix_cached']):>30}"
              f"{'tokens ' + str(t['batched']) + ' / ' + str(t['prefix_cached']):>20}   of 8")
    print(f"{'mode':<14}{'pp512 tok/s':>12}{'tg128 tok/s':>12}{'16 x 64 out tok/s':>19}")
    for m, r in table.items():
        print(f"{m:<14}{r['prefill_tok_s']:>12.0f}{r['decode_tok_s']:>12.1f}"
              f"{r['batch16_out_tok_s']:>19.1f}")
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
