"""Speculative decoding behind the server: the same greedy text with and without it, the
Prometheus counters and acceptance histogram under vLLM's names, and --speculative-config on
the command line (a bad JSON is a one-line error)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_cli_errors import assert_one_line_error, run_cli

PROMPT = " ".join(["alpha beta gamma delta epsilon"] * 6)


def complete(server, prompt: str, max_tokens: int = 24) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_server_speculates_and_reports_it(make_server, tiny_model):
    plain = make_server()  # the random model drafting for itself: every draft is accepted
    # not adaptive: the planner's choice depends on measured costs, and where the draft costs
    # as much as the target (the portable kernels) it rightly drafts nothing
    spec = make_server(engine_kwargs={"speculative_config": {
        "model": tiny_model, "num_speculative_tokens": 3, "adaptive": False}})
    prompts = [PROMPT, "one two three one two three one two", "hello"]
    assert [complete(spec, p) for p in prompts] == [complete(plain, p) for p in prompts]
    assert spec.async_engine.wait_idle(timeout=10)
    text = httpx.get(f"{spec.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = spec.metrics()
    drafted = values["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = values["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and accepted == drafted
    assert values["tokenmill:spec_decode_num_drafts_total"] > 0
    hist = families["tokenmill:spec_decode_acceptance_length"]
    assert hist.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in hist.samples}
    steps = values["tokenmill:spec_decode_num_drafts_total"]
    assert samples[("tokenmill:spec_decode_acceptance_length_count", None)] == steps
    assert samples[("tokenmill:spec_decode_acceptance_length_sum", None)] == accepted
    assert samples[("tokenmill:spec_decode_acceptance_length_bucket", "+Inf")] == steps
    assert "tokenmill:spec_decode_num_drafts" not in {
        f.name for f in text_string_to_metric_families(httpx.get(f"{plain.url}/metrics").text)}


@pytest.mark.parametrize("value,message", [("{oops", "not valid JSON"),
                                           ('{"method": "ngram"}', "num_speculative_tokens")])
def test_bad_speculative_config_flag_is_one_line(tiny_model, tmp_path, value, message):
    result = run_cli("generate", tiny_model, "hi", "--speculative-config", value,
                     home=tmp_path)
    assert result.returncode != 0
    assert message in assert_one_line_error(result.stderr)
