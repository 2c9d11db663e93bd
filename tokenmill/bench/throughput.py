"""`tokenmill bench throughput`: offline batch generation with continuous batching. Random
prompts and output lengths (fixed seed, ignore_eos); reports requests/s and tokens/s.
Prints a table, then one JSON line."""

from __future__ import annotations

import random
import time


def add_parser(sub) -> None:
    from tokenmill.bench.offline import add_model_args
    from tokenmill.commands.common import DEFAULT_MODEL

    p = sub.add_parser("throughput", help="offline batch throughput (requests/s, tokens/s)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024],
                   metavar=("MIN", "MAX"))
    add_model_args(p, DEFAULT_MODEL)
    p.set_defaults(run=run)


def workload(args, vocab: int):
    from tokenmill import SamplingParams
    from tokenmill.bench.offline import random_prompt

    rng = random.Random(args.seed)
    prompts, params = [], []
    for _ in range(args.num_prompts):
        prompts.append(random_prompt(rng, vocab, rng.randint(*args.input_len)))
        params.append(SamplingParams(temperature=0, ignore_eos=True,
                                     max_tokens=rng.randint(*args.output_len)))
    return prompts, params


def run(args) -> int:
    from tokenmill.bench.offline import emit, make_llm

    longest = args.input_len[1] + args.output_len[1]
    llm = make_llm(args, max_model_len=args.max_model_len or longest)
    prompts, params = workload(args, llm.engine.model_config.vocab_size)
    llm.generate(prompts[0], params[0].__class__(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    stats = llm.engine.stats()
    result = {
        "benchmark": "throughput", "model": args.model, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "seconds": elapsed,
        "requests_s": len(outs) / elapsed, "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed, "output_tokens": out_tokens,
        "input_tokens": in_tokens, "preemptions": stats["num_preemptions"],
        "kernels": llm.engine.runner.kernels,
    }
    print(f"{args.num_prompts} requests, input {args.input_len}, output {args.output_len}: "
          f"{elapsed:.1f} s, {stats['num_preemptions']} preemptions")
    print(f"  requests/s      {result['requests_s']:10.2f}")
    print(f"  output tok/s    {result['output_tok_s']:10.1f}")
    print(f"  total tok/s     {result['total_tok_s']:10.1f}")
    emit(result)
    return 0
