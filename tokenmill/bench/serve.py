"""`tokenmill bench serve`: a load generator for any OpenAI-compatible server (tokenmill, vLLM,
llama.cpp): synthetic prompts sent as streaming completions at a Poisson request rate or a
fixed concurrency; prints `vllm bench serve`'s table, then one JSON line."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from datetime import datetime


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", help="model name to request (default: the server's first)")
    p.add_argument("--api-key", help="bearer key (default: $TOKENMILL_API_KEY, $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1-r)..len*(1+r); 0 = fixed lengths")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="words of one prefix every prompt starts with (prefix caching)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos/min_tokens (servers that reject extra fields)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every request (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--save-result", metavar="PATH", help="write the results as JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    from tokenmill.bench.prompts import random_requests

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf sends everything at once)")
    requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.shared_prefix_len, args.seed)
    return asyncio.run(_benchmark(args, requests))


async def _arrivals(items: list, rate: float, rng: random.Random):
    """Items spaced by exponential gaps (a Poisson process) of mean 1/rate seconds."""
    for i, item in enumerate(items):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield item


async def _first_model(client, base_url: str, headers: dict) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _benchmark(args, requests) -> int:
    import httpx
    from tqdm.auto import tqdm

    from tokenmill.bench.openai_client import completion_payload, stream_completion

    base = args.base_url.rstrip("/")
    key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = base + args.endpoint
    # a connection per request: reusing kept-alive ones, llama-server dropped ~1 request in 64
    # unread ("Server disconnected without sending a response"; 4 of 5 cold runs on a Zen 2,
    # none of 3 with this), at the same throughput
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests),
                          max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        try:
            model = args.model or await _first_model(client, base, headers)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise RuntimeError(f"cannot list models at {base}/v1/models: {e}") from e

        def payload(r):
            return completion_payload(model, r.prompt, r.output_len, not args.no_ignore_eos,
                                      args.temperature, args.top_p)

        warm = await stream_completion(client, url, payload(requests[0]), headers)
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        limit = asyncio.Semaphore(args.max_concurrency or len(requests))
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, unit="req")

        async def one(r):
            async with limit:
                result = await stream_completion(client, url, payload(r), headers)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(r))
                 async for r in _arrivals(requests, args.request_rate, random.Random(args.seed))]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return _report(args, model, requests, results, duration)


def _report(args, model: str, requests, results, duration: float) -> int:
    from tokenmill.bench.serve_metrics import calculate_metrics, format_table, output_tokens

    metrics = calculate_metrics(results, duration, [r.prompt_len for r in requests])
    print(format_table(metrics, args.request_rate, args.max_concurrency))
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    summary = {"benchmark": "serve", "base_url": args.base_url, "model": model,
               "num_prompts": len(requests), "request_rate": rate,
               "max_concurrency": args.max_concurrency, "input_len": args.input_len,
               "output_len": args.output_len, "shared_prefix_len": args.shared_prefix_len,
               **metrics}
    if args.save_result:
        detail = {"date": datetime.now().isoformat(timespec="seconds"),
                  "input_lens": [r.prompt_tokens or q.prompt_len
                                 for r, q in zip(results, requests)],
                  "output_lens": [output_tokens(r) if r.success else 0 for r in results],
                  "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                  "errors": [r.error for r in results]}
        with open(args.save_result, "w") as f:
            json.dump({**summary, **detail}, f, indent=2)
    if metrics["failed"]:
        first = next(r.error for r in results if not r.success)
        print(f"{metrics['failed']} requests failed; first error: {first}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if metrics["completed"] else 1
