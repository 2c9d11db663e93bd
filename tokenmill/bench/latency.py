"""`tokenmill bench latency`: one request at a time. Prefill speed (TTFT), decode speed (mean
inter-token latency, tokens/s) and the memory bandwidth the decode achieves (weight bytes read
per token / ITL), and the process's resident memory: after start-up, at its start-up peak and
at its peak over the whole run. Prints a table, then one JSON line."""

from __future__ import annotations

import random
import statistics


def add_parser(sub) -> None:
    from tokenmill.bench.offline import add_model_args
    from tokenmill.commands.common import DEFAULT_MODEL

    p = sub.add_parser("latency", help="single-stream TTFT, ITL, tok/s and achieved GB/s")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3, help="measured runs (after a warm-up)")
    add_model_args(p, DEFAULT_MODEL)
    p.set_defaults(run=run)


def run(args) -> int:
    from tokenmill import SamplingParams
    from tokenmill.bench.offline import (
        emit,
        make_llm,
        random_prompt,
        weight_bytes_per_token,
        weight_format,
    )
    from tokenmill.engine.memory import peak_rss

    llm = make_llm(args, max_num_seqs=1,
                   max_model_len=args.max_model_len or args.input_len + args.output_len + 16)
    engine = llm.engine
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    llm.generate(random_prompt(rng, vocab, args.input_len), params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(args.num_iters):
        out = llm.generate(random_prompt(rng, vocab, args.input_len), params, use_tqdm=False)[0]
        m = out.metrics
        runs.append((m.time_to_first_token, m.mean_inter_token_latency, m.e2e_latency,
                     m.num_draft_tokens, m.num_accepted_tokens, len(m.token_times)))
    ttft = statistics.median(r[0] for r in runs)
    itl = statistics.median(r[1] for r in runs)
    e2e = statistics.median(r[2] for r in runs)
    weights = weight_bytes_per_token(engine.runner.model)
    drafted, accepted, steps = (sum(r[i] for r in runs) for i in (3, 4, 5))
    result = {
        "benchmark": "latency", "model": args.model, "dtype": str(engine.dtype).split(".")[-1],
        "kernels": engine.runner.kernels, "weights": weight_format(engine.runner.model),
        "input_len": args.input_len,
        "output_len": args.output_len, "ttft_s": ttft, "prefill_tok_s": args.input_len / ttft,
        "itl_s": itl, "decode_tok_s": 1.0 / itl, "e2e_s": e2e,
        "weight_bytes_per_token": weights, "achieved_gb_s": weights / itl / 1e9,
        "rss_after_start_mib": engine.memory.rss / 2**20,
        "startup_peak_rss_mib": engine.memory.peak_rss / 2**20,
        "peak_rss_mib": peak_rss() / 2**20,
        "speculative": engine.spec.config.method if engine.spec else None,
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": args.output_len * args.num_iters / steps,
    }
    kernels = "on" if result["kernels"] else "off"
    print(f"model {args.model} ({result['dtype']} activations, weights {result['weights']}, "
          f"kernels {kernels}), "
          f"prompt {args.input_len}, output {args.output_len}, median of {args.num_iters}")
    print(f"  TTFT            {ttft * 1e3:9.1f} ms   ({result['prefill_tok_s']:.0f} prompt tok/s)")
    print(f"  mean ITL        {itl * 1e3:9.2f} ms   ({result['decode_tok_s']:.1f} tok/s)")
    print(f"  end to end      {e2e:9.2f} s")
    if engine.spec is not None:
        rate = f"{100 * result['acceptance_rate']:.1f}%" if drafted else "n/a"
        print(f"  speculative     {engine.spec.config.method}: {accepted} of {drafted} drafted "
              f"tokens accepted ({rate}), {result['tokens_per_step']:.2f} tokens per step")
    print(f"  weights/token   {weights / 2**20:9.1f} MiB  -> {result['achieved_gb_s']:.1f} GB/s "
          "achieved in decode")
    print(f"  resident        {result['rss_after_start_mib']:9.0f} MiB after start-up "
          f"(start-up peak {result['startup_peak_rss_mib']:.0f}), peak "
          f"{result['peak_rss_mib']:.0f} MiB")
    emit(result)
    return 0
