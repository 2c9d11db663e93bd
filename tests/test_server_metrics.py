"""/metrics: the official text parser reads it, every metric the issue names is there under
`tokenmill:`, and the histograms and counters count exactly the requests we sent."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "kv_cache_used_bytes"]
COUNTERS = ["prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "num_preemptions"]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


def families(server) -> dict:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_every_named_metric_is_exposed(server):
    found = families(server)
    for name in HISTOGRAMS:
        assert found[f"tokenmill:{name}"].type == "histogram"
    for name in GAUGES:
        assert found[f"tokenmill:{name}"].type == "gauge"
    for name in COUNTERS:
        family = found[f"tokenmill:{name}"]
        assert family.type == "counter"
        assert any(s.name == f"tokenmill:{name}_total" for s in family.samples)
        assert all(s.labels.get("model_name") == "tiny" for s in family.samples)
    rss = found["process_resident_memory_bytes"].samples[0].value  # prometheus' process collector
    assert 50 * 2**20 < rss < 64 * 2**30


def test_histograms_and_counters_count_the_requests(server):
    before = server.metrics()
    prompt = " ".join(["alpha beta gamma delta"] * 8)  # 32 tokens: 1 full cacheable block
    sizes = [3, 5, 8]
    for max_tokens in sizes:
        r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200
    stream = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
        "stream": True})
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert server.async_engine.wait_idle(timeout=10)
    after = server.metrics()

    def delta(name: str) -> float:
        return after[f"tokenmill:{name}"] - before.get(f"tokenmill:{name}", 0.0)

    n_requests = len(sizes) + 1
    all_tokens = sum(sizes) + 4
    assert delta("time_to_first_token_seconds_count") == n_requests
    assert delta("e2e_request_latency_seconds_count") == n_requests
    # One inter-token gap per token after the first (one token per step here).
    assert delta("inter_token_latency_seconds_count") == all_tokens - n_requests
    assert delta("generation_tokens_total") == all_tokens
    assert delta("prompt_tokens_total") >= 3 * 32
    assert delta("prefix_cache_queries_total") == delta("prompt_tokens_total")
    assert delta("prefix_cache_hits_total") >= 2 * 16  # the 2nd and 3rd reuse block 1
    assert delta("e2e_request_latency_seconds_sum") >= delta("time_to_first_token_seconds_sum")
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    assert after["tokenmill:kv_cache_used_bytes"] == 0.0
