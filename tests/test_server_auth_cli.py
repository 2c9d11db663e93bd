"""--api-key: /v1 routes need `Authorization: Bearer KEY` (401 otherwise, before the body is
even parsed); /health and /metrics stay open. And `tokenmill serve` itself, as a process:
loopback by default, --port 0, TOKENMILL_API_KEY from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
KEY = "sk-test-123"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(api_key=KEY)


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}, {"Authorization": "Basic " + KEY}],
                         ids=["missing", "wrong", "no-scheme", "basic"])
def test_missing_or_wrong_key_is_401(server, headers):
    for method, path, body in [("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions", {"messages": []}),
                               ("GET", "/v1/models", None), ("GET", "/docs", None),
                               ("GET", "/openapi.json", None)]:
        assert_401(httpx.request(method, server.url + path, json=body, headers=headers))
    # Malformed JSON from a stranger still gets 401: the key is checked first.
    assert_401(httpx.post(server.url + "/v1/completions", content=b"{", headers=headers))


def test_openai_client_with_wrong_key_gets_authentication_error(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_right_key_works_and_health_is_open(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_openapi_schema_describes_the_400s_actually_sent(server):
    schema = httpx.get(f"{server.url}/openapi.json",
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})


def test_serve_command(tiny_model):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENMILL_API_KEY": KEY}
    cmd = [sys.executable, "-m", "tokenmill", "serve", tiny_model, "--port", "0",
           "--served-model-name", "tiny", "alias", "--max-model-len", "128",
           "--kv-cache-memory", "1MiB"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()  # printed once the socket listens
        assert line.startswith("tokenmill serve: 'tiny' on http://127.0.0.1:"), (
            line + proc.stderr.read() if not line else line)
        base = line.split(" on ")[1].strip()
        assert_401(httpx.get(f"{base}/models", timeout=30))
        auth = {"Authorization": f"Bearer {KEY}"}
        models = httpx.get(f"{base}/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "alias"]
        r = httpx.post(f"{base}/completions", headers=auth, timeout=30,
                       json={"model": "alias", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        r = httpx.post(f"{base}/completions", headers=auth, timeout=30,
                       json={"prompt": "hi", "max_tokens": 200})
        assert r.status_code == 400 and "max_model_len (128)" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode in (0, -15)
