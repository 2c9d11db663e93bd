"""Resident memory with default settings, tokenmill against llama.cpp's llama-server on the same
GGUF file (the default model), in the same run:

- `LLM(model)` in a fresh process: growth after start-up and after one short request, the
  start-up peak (VmHWM) against the final RSS;
- each server started with its defaults: idle RSS and start-up peak, RSS after one short chat
  request, and after a ~2,000-token multi-turn conversation (growth against the KV bytes those
  tokens take: tokens x the model's bytes per token in the server's default cache dtype);
- `tokenmill generate --kv-cache-memory` of twice the machine's RAM: exit code and seconds.

    python benchmarks/memory.py [--model smollm2-135m-instruct] [--no-llama-cpp]
Prints a table and ends with one JSON line. Linux only (reads /proc/PID/status).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import emit_json, machine, print_table  # noqa: E402
from benchmarks.serve_compare import child_env, free_port, stop, wait_healthy  # noqa: E402

MiB = 2**20
ESSAY = (ROOT / "benchmarks" / "data" / "mill_essay.txt").read_text().split("\n\n")

OFFLINE = r"""
import json, sys
from tokenmill.engine.memory import rss
from tokenmill import LLM, SamplingParams
base = rss()
llm = LLM(sys.argv[1])
started, m = rss(), llm.engine.memory
llm.generate("What is the capital of France?", SamplingParams(max_tokens=16, temperature=0),
             use_tqdm=False)
print(json.dumps({"base": base, "started": started, "peak": m.peak_rss, "after_request": rss(),
                  "model": m.model, "kv_budget": m.kv_budget, "kv_bytes_per_token":
                  m.kv_bytes_per_token}))
"""


def status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["total_tokens"]


def conversation(url: str, tokens: int) -> int:
    """Turns of 'summarize this paragraph' until the conversation holds `tokens` tokens."""
    messages, total, i = [], 0, 0
    while total < tokens:
        messages.append({"role": "user", "content": "Summarize:\n" + ESSAY[i % len(ESSAY)]})
        reply, total = chat(url, messages, 64)
        messages.append({"role": "assistant", "content": reply})
        i += 1
    return total


def server(name: str, cmd: list[str], port: int, tokens: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env())
    try:
        wait_healthy(url, proc)
        time.sleep(1.0)  # let the last start-up work settle
        row = {"engine": name, "idle_mib": status(proc.pid, "VmRSS") / MiB,
               "startup_peak_mib": status(proc.pid, "VmHWM") / MiB}
        chat(url, [{"role": "user", "content": "What is the capital of France?"}], 16)
        row["after_request_mib"] = before = status(proc.pid, "VmRSS") / MiB
        row["conversation_tokens"] = conversation(url, tokens)
        row["after_conversation_mib"] = status(proc.pid, "VmRSS") / MiB
        row["conversation_growth_mib"] = row["after_conversation_mib"] - before
        row["peak_mib"] = status(proc.pid, "VmHWM") / MiB
        return row
    finally:
        stop(proc)


def oversized_budget(model: str) -> dict:
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "generate", model, "hi",
                           "--kv-cache-memory", str(2 * ram)], capture_output=True, text=True,
                          cwd=ROOT)
    return {"exit_code": proc.returncode, "seconds": time.perf_counter() - start,
            "message": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--conversation-tokens", type=int, default=2000)
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    from tokenmill.loaders.resolve import resolve_model

    gguf = resolve_model(args.model)
    out = subprocess.run([sys.executable, "-c", OFFLINE, gguf], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    off = json.loads(out.stdout.strip().splitlines()[-1])
    offline = {"growth_after_start_mib": (off["started"] - off["base"]) / MiB,
               "growth_after_request_mib": (off["after_request"] - off["base"]) / MiB,
               "rss_mib": off["started"] / MiB, "startup_peak_mib": off["peak"] / MiB,
               "peak_over_final": off["peak"] / off["started"], "model_mib": off["model"] / MiB,
               "kv_budget_mib": off["kv_budget"] / MiB}
    print(f"LLM({args.model!r}), default settings: +{offline['growth_after_start_mib']:.0f} MiB "
          f"after start-up, +{offline['growth_after_request_mib']:.0f} MiB after one request "
          f"(model {offline['model_mib']:.0f} MiB resident, KV budget "
          f"{offline['kv_budget_mib']:.0f} MiB mapped on use); RSS {offline['rss_mib']:.0f} MiB, "
          f"start-up peak {offline['startup_peak_mib']:.0f} ({offline['peak_over_final']:.2f}x)")

    port = free_port()
    engines = {"tokenmill": [sys.executable, "-m", "tokenmill", "serve", gguf, "--port",
                             str(port)]}
    if not args.no_llama_cpp:
        llama = Path(subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_cpp.sh")],
                                    capture_output=True, text=True, check=True).stdout.strip())
        engines["llama.cpp"] = [str(llama / "llama-server"), "-m", gguf, "--port", str(port),
                                "--no-webui"]
    rows = [server(name, cmd, port, args.conversation_tokens) for name, cmd in engines.items()]
    per_token = off["kv_bytes_per_token"]
    for r in rows:
        r["kv_bytes_mib"] = r["conversation_tokens"] * per_token / MiB
    print_table(rows, ["engine", "idle_mib", "startup_peak_mib", "after_request_mib",
                       "conversation_tokens", "conversation_growth_mib", "kv_bytes_mib",
                       "peak_mib"])
    refused = oversized_budget(gguf)
    print(f"--kv-cache-memory 2x RAM: exit code {refused['exit_code']} after "
          f"{refused['seconds']:.1f} s: {refused['message']}")
    emit_json({"benchmark": "memory", "model": args.model, **machine(), "offline": offline,
               "servers": rows, "oversized_kv_budget": refused})


if __name__ == "__main__":
    main()
