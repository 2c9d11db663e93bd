"""Speculative decoding benchmark: tokenmill with and without drafts, and llama.cpp's
llama-server with and without its n-gram speculation, on the same prompts in the same run.

Workloads (benchmarks/data/spec_prompts.json, chat-formatted, greedy, up to --max-tokens):
'grounded' answers copy from the prompt (code with type hints, typo fixes, extraction into
JSON); 'free' answers are free writing. Measured:
- single stream: one request at a time; decode speed = tokens after the first / (end - first
  token), summed over the prompts (the metric speculation changes; TTFT it does not). Every
  prompt runs on every engine in turn, so the machine's drift (10-20% here) hits all alike;
- 16 concurrent: 32 requests (every prompt in 4 variants, so nothing is cached whole) through
  16 batch slots, as 16 clients sending one request after another would: output tokens / time.
  The engines run side by side, a step of each in turn, each timed by its own steps, so the
  machine's drift hits all alike;
- bf16 target: the default model dequantized to bfloat16, with n-gram drafts (single stream
  and 16 concurrent: where a decode step's GEMMs have room for more rows, as bf16 tiles on an
  AMX CPU do, verifying drafts costs little even in a batch) and drafted by its own Q4_1 file
  (native int8-activation kernels; single stream): an honest stand-in for a small draft of a
  larger model with the same vocabulary.
- llama.cpp: llama-server (built by build_llama_cpp.sh) single stream, with and without
  `--spec-type ngram-simple`, decode speed from its own timings.
Prints a table and ends with one JSON line.

    python benchmarks/spec_decode.py [--max-tokens 256] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine  # noqa: E402

PROMPTS = json.loads((ROOT / "benchmarks" / "data" / "spec_prompts.json").read_text())
CONFIGS = {
    "none": None,
    "ngram k8 n2-8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 8},
    "ngram k8 n1-8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 8},
    "ngram k4 n4 (vLLM's defaults)": {"method": "ngram", "num_speculative_tokens": 4,
                                      "prompt_lookup_max": 4},
    "suffix k8": {"method": "suffix", "num_speculative_tokens": 8},
}


VARIANTS = ["", "\n\nAnswer carefully.", "\n\nBe concise.", "\n\nThank you!"]


def conversations(kind: str, variants: int = 1) -> list[list[dict]]:
    """The prompts of a kind; with variants > 1, each again with a closing sentence (so no
    answer is served whole from the prefix cache)."""
    return [[{"role": "user", "content": p + v}] for v in VARIANTS[:variants]
            for p in PROMPTS[kind]]


def _order(engines: dict, r: int) -> list:
    """The engines in turn, reversed every other round (identical engines measured 5% apart
    by position alone)."""
    items = list(engines.items())
    return items if r % 2 == 0 else items[::-1]


def single_stream(engines: dict, kind: str, max_tokens: int, rounds: int) -> dict:
    """Every prompt on every engine in turn (so a machine's drift hits all alike)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    acc = {name: dict(tokens=0, seconds=0.0, drafted=0, accepted=0, steps=0, outputs=[])
           for name in engines}
    for llm in engines.values():
        llm.chat(conversations(kind)[0], params, use_tqdm=False)  # warm-up
    for r in range(rounds):
        for conv in conversations(kind):
            for name, llm in _order(engines, r):
                out = llm.chat(conv, params, use_tqdm=False)[0]
                m, a = out.metrics, acc[name]
                a["tokens"] += len(out.outputs[0].token_ids) - 1
                a["seconds"] += m.token_times[-1] - m.token_times[0]
                a["drafted"] += m.num_draft_tokens
                a["accepted"] += m.num_accepted_tokens
                a["steps"] += len(m.token_times) - 1
                a["outputs"].append(out.outputs[0].token_ids)
    return {name: {"decode_tok_s": a["tokens"] / a["seconds"], "tokens": a["tokens"],
                   "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else None,
                   "tokens_per_step": a["tokens"] / a["steps"], "outputs": a["outputs"]}
            for name, a in acc.items()}


def concurrent(engines: dict, kind: str, max_tokens: int, rounds: int) -> dict:
    """32 requests (every prompt in 4 variants) through 16 batch slots per engine (continuous
    batching: a finished request's slot is taken by the next), `rounds` times. The engines run
    side by side, one step of each in turn, and an engine's time is the sum of its own steps:
    the machine's drift (20% from one run to the next here) then hits every engine alike at
    the grain of a step. (Run after run, two identical engines measured up to 20% apart; step
    after step, within 1.5%.)"""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    convs = conversations(kind, variants=4)
    acc = {name: dict(tokens=0, seconds=0.0, drafted=0, accepted=0, outputs={})
           for name in engines}
    for llm in engines.values():
        llm.chat(convs[:2], params, use_tqdm=False)  # warm-up
    for r in range(rounds):
        for name, finished, seconds in side_by_side(engines, convs, params, r):
            a = acc[name]
            a["seconds"] += seconds
            for o in finished:
                a["tokens"] += len(o.outputs[0].token_ids)
                a["drafted"] += o.metrics.num_draft_tokens
                a["accepted"] += o.metrics.num_accepted_tokens
                a["outputs"][(r, tuple(o.prompt_token_ids))] = o.outputs[0].token_ids
    return {name: {"output_tok_s": a["tokens"] / a["seconds"], "tokens": a["tokens"],
                   "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else None,
                   "outputs": a["outputs"]}
            for name, a in acc.items()}


def side_by_side(engines: dict, convs: list, params, r: int = 0):
    """Every conversation as a request on every engine, then one step of each engine in turn
    (in _order(engines, r)) until all are done; yields (engine name, its requests that finished
    in the step, the step's seconds)."""
    live = {name: {llm.engine.add_request(None, llm.chat_prompt(c), params) for c in convs}
            for name, llm in engines.items()}
    while live:
        for name, llm in _order(engines, r):
            if name not in live:
                continue
            start = time.perf_counter()
            outs = llm.engine.step()
            seconds = time.perf_counter() - start
            finished = [o for o in outs if o.finished and o.request_id in live[name]]
            live[name].difference_update(o.request_id for o in finished)
            if not live[name]:
                del live[name]
            yield name, finished, seconds


def tokenmill_rows(args, model: str) -> dict:
    from tokenmill import LLM

    rows: dict[str, dict] = {}
    engines = {name: LLM(model, max_num_seqs=16, max_model_len=2048, speculative_config=spec)
               for name, spec in CONFIGS.items()}
    for kind in ("grounded", "free"):
        for name, r in single_stream(engines, kind, args.max_tokens, args.rounds).items():
            rows.setdefault(name, {})[f"{kind} single"] = r
        for name, r in concurrent(engines, kind, args.max_tokens, args.rounds).items():
            rows[name][f"{kind} x16"] = r
    del engines
    bf16 = {name: LLM(model, dtype="bfloat16", max_num_seqs=16, max_model_len=2048,
                      speculative_config=spec) for name, spec in (
        ("bf16 target", None),
        ("bf16 target + ngram k8 n1-8", CONFIGS["ngram k8 n1-8"]),
        ("bf16 target + Q4_1 draft k4", {"model": model, "num_speculative_tokens": 4}))}
    lookup = {name: llm for name, llm in bf16.items() if "draft" not in name}
    for kind in ("grounded", "free"):
        for name, r in single_stream(bf16, kind, args.max_tokens, args.rounds).items():
            rows.setdefault(name, {})[f"{kind} single"] = r
        for name, r in concurrent(lookup, kind, args.max_tokens, args.rounds).items():
            rows[name][f"{kind} x16"] = r
    return rows


def llama_cpp_rows(args, model: str) -> dict:
    """llama-server single stream, with and without its n-gram speculation."""
    import subprocess

    import httpx

    from benchmarks.serve_compare import free_port, stop, wait_healthy

    bin_dir = Path(subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_cpp.sh")],
                                  capture_output=True, text=True, check=True).stdout.strip())
    rows = {}
    for name, extra in (("none", []), ("ngram-simple", ["--spec-type", "ngram-simple"])):
        port = free_port()
        proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", model, "--port", str(port),
                                 "-c", "4096", "-t", str(args.threads), "-tb", str(args.threads),
                                 "-np", "1", "--no-webui", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            rows[name] = {}
            for kind in ("grounded", "free"):
                tokens = ms = drafted = accepted = 0
                convs = conversations(kind)
                for i, conv in enumerate([convs[0], *convs]):  # the first is a warm-up
                    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                        "messages": conv, "max_tokens": args.max_tokens, "temperature": 0})
                    t = r.json()["timings"]
                    if i == 0:
                        continue
                    tokens += t["predicted_n"]
                    ms += t["predicted_ms"]
                    drafted += t.get("draft_n", 0)
                    accepted += t.get("draft_n_accepted", 0)
                rows[name][f"{kind} single"] = {
                    "decode_tok_s": tokens / ms * 1e3, "tokens": tokens,
                    "acceptance": accepted / drafted if drafted else None}
        finally:
            stop(proc)
    return rows


def print_table(engine: str, rows: dict, base: str) -> None:
    print(f"\n{engine}")
    columns = list(rows[base])
    print(f"  {'':32}" + "".join(f"{c:>24}" for c in columns))
    for name, row in rows.items():
        cells = []
        for c in columns:
            if c not in row:
                cells.append(f"{'':>24}")
                continue
            r, b = row[c], rows[base if c in rows[base] else name][c]
            key = "decode_tok_s" if "decode_tok_s" in r else "output_tok_s"
            ratio = r[key] / b[key]
            acc = f" a{100 * r['acceptance']:.0f}%" if r.get("acceptance") is not None else ""
            cells.append(f"{r[key]:8.1f} {ratio:5.2f}x{acc:>8}")
        print(f"  {name:32}" + "".join(f"{c:>24}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts")
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenmill.loaders.resolve import resolve_model

    model = resolve_model(args.model)
    rows = tokenmill_rows(args, model)
    for name, row in rows.items():  # exact: speculation gives the same greedy tokens
        base = rows["bf16 target" if name.startswith("bf16") else "none"]
        for col, r in row.items():
            if "outputs" in r:
                r["identical"] = r["outputs"] == base[col]["outputs"]
    for row in rows.values():
        for r in row.values():
            r.pop("outputs", None)
    llama = {} if args.no_llama_cpp else llama_cpp_rows(args, model)
    print(f"machine: {machine()}")
    print("tokens/s (decode tok/s single stream; output tok/s x16), ratio to no speculation, "
          "draft acceptance")
    print_table("tokenmill", {k: v for k, v in rows.items() if not k.startswith("bf16")}, "none")
    print_table("tokenmill, bf16 target", {k: v for k, v in rows.items() if k.startswith("bf16")},
                "bf16 target")
    differ = [f"{name} ({col})" for name, row in rows.items() for col, r in row.items()
              if not r.get("identical", True)]
    print("greedy outputs identical with and without speculation: "
          + (f"NO for {', '.join(differ)}" if differ else "yes, every method and workload"))
    if llama:
        print_table("llama.cpp llama-server", llama, "none")
    print(json.dumps({"benchmark": "spec_decode", "model": args.model, "machine": machine(),
                      "max_tokens": args.max_tokens, "tokenmill": rows, "llama.cpp": llama},
                     sort_keys=True))


if __name__ == "__main__":
    main()
