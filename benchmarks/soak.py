"""Soak test: one `tokenmill serve` (loopback only) under a bounded, mixed, partly hostile load.

32 clients (default) for --minutes: streamed chat completions read to the end, streams aborted
after a few events, plain completions, malformed or invalid requests (expect 400), bodies over
--max-request-bytes (expect 413), and connections that open and stall (closed by the server's
--request-timeout). Every --every seconds it samples the server's RSS and /metrics. At the end,
with the load stopped, the KV cache must be empty and nothing running or waiting.

First, how much a hostile client slows an ordinary one (neighbour_check). Reports requests by
kind and status, p50/p99 latency of the full streams per interval, RSS over
time, the final KV usage; exits 1 on any 5xx, an unexpected status or a KV leak. Prints a table
and ends with one JSON line.

    python benchmarks/soak.py [--minutes 30] [--clients 32] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 1 << 20
WORDS = "the a river stone light city night market song road window letter garden".split()
# kind -> (share of the requests, statuses it may get)
KINDS = {"stream": (0.55, {200}), "abort": (0.15, {200}), "complete": (0.12, {200}),
         "bad": (0.10, {400}), "oversized": (0.05, {413}), "stall": (0.03, {None})}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", "0",
           "--max-num-seqs", str(args.clients), "--threads", str(args.threads),
           "--max-model-len", "1024", "--max-request-bytes", str(MAX_BYTES),
           "--request-timeout", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        m = re.search(r"on (http://\S+)/v1", line)
        if m:
            url = m.group(1)
            break
    else:
        raise RuntimeError("the server exited before printing its address")
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))


async def one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random) -> int | None:
    """Run one request of this kind; its HTTP status (None: a stalled connection)."""
    chat = {"messages": [{"role": "user", "content": prompt(rng)}],
            "max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.8])}
    if kind in ("stream", "abort"):
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**chat, "stream": True}) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if kind == "abort" and events >= 3:
                    break  # closing the stream aborts the request
            return r.status_code
    if kind == "complete":
        return (await client.post("/v1/completions", json={
            "prompt": prompt(rng), "max_tokens": rng.randint(8, 64)})).status_code
    if kind == "bad":
        body = rng.choice(['{"messages": [', '{"messages": [], "max_tokens": 8}',
                           '{"prompt": "x", "max_tokens": -3}', '{"prompt": "x", "top_p": 7}',
                           '{"prompt": "a\\ud800b"}', '{"prompt": "x", "max_tokens": true}'])
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return (await client.post(route, content=body,
                                  headers={"content-type": "application/json"})).status_code
    if kind == "oversized":
        return (await client.post("/v1/completions", content=b'{"prompt": "' + b"a" * (
            2 * MAX_BYTES) + b'"}', headers={"content-type": "application/json"})).status_code
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and nothing more
    await reader.read()  # until the server closes it
    writer.close()
    return None


async def neighbour_check(url: str) -> dict:
    """An ordinary 32-token request's latency alone, then while hostile requests run at the
    limits (64 stop strings + 1,024 stop ids + min_tokens, 128 prompts in one request, a prompt
    of ~1 MB, a chunked body over the byte limit): how much one client can slow another."""
    ordinary = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0,
                "ignore_eos": True}
    hostile = [
        {"prompt": "hello", "max_tokens": 64, "min_tokens": 32, "ignore_eos": True,
         "stop": [f"zq{i}x" for i in range(64)], "stop_token_ids": list(range(1000, 2024))},
        {"prompt": ["tell me a story"] * 128, "max_tokens": 16},
        {"prompt": "word " * 200_000, "max_tokens": 4},
    ]

    async def oversized_chunks():
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"a" * 32768
        yield b'"}'

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def timed() -> float:
            start = time.monotonic()
            assert (await client.post("/v1/completions", json=ordinary)).status_code == 200
            return time.monotonic() - start

        alone = [await timed() for _ in range(5)]

        async def attack() -> list[int]:  # all at once, each sent again as soon as it ends
            async def again(send) -> int:
                while True:
                    status = (await send()).status_code
                    if time.monotonic() > done_by:
                        return status

            sends = [lambda b=b: client.post("/v1/completions", json=b) for b in hostile]
            sends.append(lambda: client.post("/v1/completions", content=oversized_chunks(),
                                             headers={"content-type": "application/json"}))
            return list(await asyncio.gather(*(again(send) for send in sends)))

        done_by = time.monotonic() + 10 * sum(alone)
        attacker = asyncio.create_task(attack())
        await asyncio.sleep(0.5)
        beside = [await timed() for _ in range(5)]
        statuses = await attacker
    return {"alone_s": round(statistics.median(alone), 3),
            "beside_hostile_s": round(statistics.median(beside), 3),
            "ratio": round(statistics.median(beside) / statistics.median(alone), 2),
            "hostile_statuses": statuses}


async def load(url: str, args, log: list) -> None:
    deadline = time.monotonic() + args.minutes * 60
    kinds, weights = list(KINDS), [share for share, _ in KINDS.values()]

    async def client_loop(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while time.monotonic() < deadline:
                kind, start = rng.choices(kinds, weights)[0], time.monotonic()
                try:
                    status = await one(client, url, kind, rng)
                except httpx.HTTPError as e:
                    status = f"error {type(e).__name__}"
                log.append((start, kind, status, time.monotonic() - start))

    await asyncio.gather(*(client_loop(i) for i in range(args.clients)))


def sampler(proc: psutil.Process, url: str, every: float, samples: list, stop) -> None:
    t0 = time.monotonic()
    while not stop.wait(every):
        m = metrics(url)
        samples.append({"t_s": round(time.monotonic() - t0), "rss_mib": round(
            proc.memory_info().rss / 2**20), "kv_usage": m.get("tokenmill:kv_cache_usage_perc"),
            "running": m.get("tokenmill:num_requests_running")})


def report(log: list, samples: list, final: dict, args) -> dict:
    t0 = min(start for start, *_ in log)
    by_kind = {k: Counter(str(s) for _, kind, s, _ in log if kind == k) for k in KINDS}
    unexpected = [(k, s) for _, k, s, _ in log if s not in KINDS[k][1]]
    intervals = {}
    for start, kind, status, took in log:
        if kind == "stream" and status == 200:
            intervals.setdefault(int((start - t0) // (args.every)), []).append(took)
    lat = [{"t_s": int(i * args.every), "n": len(v), "p50_s": round(statistics.median(v), 3),
            "p99_s": round(sorted(v)[max(0, int(0.99 * len(v)) - 1)], 3)}
           for i, v in sorted(intervals.items())]
    return {"benchmark": "soak", "model": args.model, "minutes": args.minutes,
            "clients": args.clients, "requests": len(log), "by_kind": by_kind,
            "unexpected": unexpected[:20], "num_unexpected": len(unexpected),
            "stream_latency": lat, "samples": samples, "final": final,
            "passed": not unexpected and final["kv_usage"] == 0 and final["running"] == 0}


def main() -> None:
    import threading

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", type=float, default=60, help="seconds between samples")
    args = ap.parse_args()
    proc, url = start_server(args)
    log, samples, stop = [], [], threading.Event()
    try:
        watcher = threading.Thread(target=sampler, args=(psutil.Process(proc.pid), url,
                                                         args.every, samples, stop))
        neighbour = asyncio.run(neighbour_check(url))
        watcher.start()
        asyncio.run(load(url, args, log))
        stop.set()
        watcher.join()
        time.sleep(2)  # aborted streams' last steps
        m = metrics(url)
        final = {"kv_usage": m["tokenmill:kv_cache_usage_perc"],
                 "running": m["tokenmill:num_requests_running"],
                 "waiting": m["tokenmill:num_requests_waiting"],
                 "rss_mib": round(psutil.Process(proc.pid).memory_info().rss / 2**20)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {**report(log, samples, final, args), "neighbour": neighbour}
    n = result["neighbour"]
    print(f"ordinary 32-token request: {n['alone_s']} s alone, {n['beside_hostile_s']} s beside "
          f"hostile ones ({n['ratio']}x; their statuses {n['hostile_statuses']})")
    print(f"soak: {args.minutes} min, {args.clients} clients, {result['requests']} requests "
          f"against {args.model}")
    for kind, statuses in result["by_kind"].items():
        print(f"  {kind:<10} {dict(statuses)}")
    print(f"{'t (s)':>6} {'streams':>8} {'p50 s':>7} {'p99 s':>7} {'RSS MiB':>8} {'KV use':>7}")
    for row, sample in zip(result["stream_latency"], samples + [{}] * len(samples)):
        print(f"{row['t_s']:>6} {row['n']:>8} {row['p50_s']:>7} {row['p99_s']:>7} "
              f"{sample.get('rss_mib', ''):>8} {sample.get('kv_usage', '')!s:>7}")
    print(f"end: KV usage {final['kv_usage']}, running {final['running']}, waiting "
          f"{final['waiting']}, RSS {final['rss_mib']} MiB; unexpected statuses "
          f"{result['num_unexpected']}: {'PASS' if result['passed'] else 'FAIL'}")
    print(json.dumps(result, default=str))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
