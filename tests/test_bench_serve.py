"""`tokenmill bench serve`: vLLM's metric definitions on hand-made timings, the synthetic
prompts, and the command itself against our server (table, JSON line, --save-result)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.bench.openai_client import RequestResult
from tokenmill.bench.prompts import random_requests
from tokenmill.bench.serve_metrics import calculate_metrics, format_table

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_metrics_follow_vllm_definitions():
    a = RequestResult(success=True, prompt_tokens=10, output_tokens=5, num_chunks=5, ttft=0.1,
                      itl=[0.02, 0.02, 0.04, 0.02], latency=0.2)
    b = RequestResult(success=True, prompt_tokens=20, output_tokens=3, num_chunks=2, ttft=0.3,
                      itl=[0.1], latency=0.5)  # 3 tokens in 2 chunks: TPOT uses tokens
    failed = RequestResult(success=False, error="HTTP 500")
    m = calculate_metrics([a, b, failed], duration=2.0, input_lens=[0, 0, 7])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT per request = (latency - ttft) / (output_tokens - 1): 25 ms and 100 ms.
    assert m["mean_tpot_ms"] == pytest.approx(62.5)
    assert m["p99_tpot_ms"] == pytest.approx(25 + 0.99 * 75)
    # ITL pools every gap of every request: 20, 20, 40, 20, 100 ms.
    assert m["mean_itl_ms"] == pytest.approx(40.0)
    assert m["median_itl_ms"] == pytest.approx(20.0)
    assert m["mean_e2el_ms"] == pytest.approx(350.0)
    table = format_table(m, float("inf"), None)
    assert "Mean TPOT (ms):" in table and "62.50" in table


def test_single_token_outputs_have_no_tpot():
    r = RequestResult(success=True, output_tokens=1, num_chunks=1, ttft=0.1, latency=0.1)
    m = calculate_metrics([r], duration=1.0, input_lens=[4])
    assert m["total_input_tokens"] == 4  # no usage from the server: the prompt's length
    assert m["mean_tpot_ms"] == 0.0 and m["mean_itl_ms"] == 0.0


def test_random_prompts():
    fixed = random_requests(8, input_len=12, output_len=5, shared_prefix_len=4, seed=1)
    assert all(len(r.prompt.split()) == 16 and r.output_len == 5 for r in fixed)
    assert len({" ".join(r.prompt.split()[:4]) for r in fixed}) == 1  # the shared prefix
    assert len({r.prompt for r in fixed}) == 8
    varied = random_requests(50, input_len=10, output_len=10, range_ratio=0.5, seed=1)
    assert {len(r.prompt.split()) for r in varied} <= set(range(5, 16))
    assert len({r.output_len for r in varied}) > 3
    assert random_requests(3, 5, 5, seed=7) == random_requests(3, 5, 5, seed=7)
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(3, 5, 5, range_ratio=1.5)


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


def test_bench_serve_command(server, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", server.url,
           "--num-prompts", "12", "--input-len", "20", "--output-len", "6",
           "--max-concurrency", "4", "--shared-prefix-len", "16", "--temperature", "0.8",
           "--top-p", "0.9", "--save-result", str(out)]  # sampled, as chat clients ask
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "Serving Benchmark Result" in lines[0]
    for label in ("Successful requests:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Median TTFT (ms):", "P99 TPOT (ms):",
                  "Mean ITL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    summary = json.loads(lines[-1])  # the output ends with one JSON line
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["model"] == "tiny"
    assert summary["total_output_tokens"] == 12 * 6  # ignore_eos + max_tokens were honoured
    assert summary["total_input_tokens"] >= 12 * 36
    assert 0 < summary["median_ttft_ms"] and 0 < summary["mean_tpot_ms"]
    saved = json.loads(out.read_text())
    assert saved["completed"] == 12
    assert len(saved["ttfts"]) == len(saved["itls"]) == 12
    assert saved["output_lens"] == [6] * 12
    assert all(len(gaps) == 5 for gaps in saved["itls"])  # one chunk per token here
