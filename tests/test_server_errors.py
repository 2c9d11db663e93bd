"""Bad requests get their status code and an OpenAI-style JSON error body naming the problem,
and the server keeps answering: 400, 404, 413, 429, 500 after a failed engine step."""

from __future__ import annotations

import threading

import httpx
import pytest

LONG = " ".join(["hello"] * 300)  # 300 tokens with GPT-2's tokenizer; max_model_len is 256


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


def post(server, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, str):
        kwargs["content"] = body
        kwargs.setdefault("headers", {"Content-Type": "application/json"})
    else:
        kwargs["json"] = body
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["type"]
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param


COMPLETION_CASES = [
    ('{"prompt": "hi", "max_tokens": ', 400, ["not valid JSON"], None),
    ('["a", "list"]', 400, ["dictionary"], None),
    ({}, 400, ["prompt", "required"], "prompt"),
    ({"prompt": 5}, 400, ["prompt", "wrong type"], "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, ["max_tokens", "integer"], "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    ({"prompt": "hi", "stream": "maybe"}, 400, ["stream"], "stream"),
    ({"prompt": "hi", "temperature": -1}, 400, ["temperature must be in [0, 100]"],
     "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, ["top_p must be in (0, 1]"], "top_p"),
    ({"prompt": "hi", "n": 0}, 400, ["n must be"], "n"),
    ({"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens must be"], "max_tokens"),
    ({"prompt": "hi", "logprobs": 50}, 400, ["logprobs must be"], "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, ["presence_penalty"], "presence_penalty"),
    ({"prompt": LONG}, 400, ["prompt is 300 tokens", "max_model_len is 256"], "prompt"),
    ({"prompt": "hi", "max_tokens": 1000}, 400, ["1000", "max_model_len (256)"], "max_tokens"),
    ({"prompt": [99999999]}, 400, ["token ids", "50257"], "prompt"),
    ({"prompt": []}, 400, ["empty"], "prompt"),
    ({"prompt": "hi", "echo": True}, 400, ["echo"], "echo"),
    ({"prompt": "hi", "max_tokens": True}, 400, ["max_tokens", "integer"], "max_tokens"),
    ({"prompt": "hi", "n": "2"}, 400, ["n", "integer"], "n"),
    ({"prompt": "hi", "model": "gpt-17"}, 404, ["gpt-17", "does not exist"], "model"),
    ('{"prompt": "a\\ud800b"}', 400, ["not valid Unicode", "U+D800", "character 1"], "prompt"),
]


@pytest.mark.parametrize("body,status,words,param", COMPLETION_CASES,
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(COMPLETION_CASES)])
def test_bad_completion_requests(server, body, status, words, param):
    assert_error(post(server, "/v1/completions", body), status, *words, param=param)


CHAT_CASES = [
    ({"messages": []}, 400, ["messages"], "messages"),
    ({"messages": [{"content": "no role"}]}, 400, ["role"], "messages"),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, ["max_model_len is 256"],
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     ["only text"], None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, ["logprobs"],
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
     400, ["top_logprobs must be", "50"], "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, ["nope"], "model"),
    ('{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400,
     ["not valid Unicode", "U+DFFF"], "messages"),
]


@pytest.mark.parametrize("body,status,words,param", CHAT_CASES,
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(CHAT_CASES)])
def test_bad_chat_requests(server, body, status, words, param):
    assert_error(post(server, "/v1/chat/completions", body), status, *words, param=param)


def test_unknown_route_and_method_are_json(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    r = httpx.get(f"{server.url}/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


def test_head_health_and_one_model(server):
    r = httpx.head(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b""
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    card = httpx.get(f"{server.url}/v1/models/{name}").json()
    assert card["id"] == name and card["object"] == "model"
    assert_error(httpx.get(f"{server.url}/v1/models/nope"), 404, "nope", param="model")


def test_streaming_request_errors_before_the_stream_starts(server):
    r = post(server, "/v1/completions", {"prompt": LONG, "stream": True})
    assert_error(r, 400, "300 tokens")
    assert r.headers["content-type"].startswith("application/json")


def test_server_still_serves_after_bad_requests(server):
    for body, *_ in COMPLETION_CASES:
        post(server, "/v1/completions", body)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.async_engine.wait_idle(timeout=10)
    assert server.engine.block_manager.num_free_blocks == server.engine.block_manager.num_blocks


def test_failed_engine_step_is_a_500_and_the_server_lives_on(server, monkeypatch):
    real = server.engine.runner.execute

    def broken(scheduled, rows, targets, masks=None):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(server.engine.runner, "execute", broken)
    assert_error(post(server, "/v1/completions", {"prompt": "hi"}), 500, "injected fault")
    r = post(server, "/v1/completions", {"prompt": "hi", "stream": True})
    assert r.status_code == 200  # the stream had started: the error is an event, then [DONE]
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert "injected fault" in events[-2] and events[-1] == "data: [DONE]"
    monkeypatch.setattr(server.engine.runner, "execute", real)
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert server.async_engine.wait_idle(timeout=10)
    assert server.engine.block_manager.num_free_blocks == server.engine.block_manager.num_blocks


def test_queue_full_is_429(make_server):
    small = make_server(engine_kwargs=dict(max_num_seqs=1), max_queued_requests=1)
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    url = f"{small.url}/v1/completions"
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
        with a.stream("POST", url, json=body) as running:
            lines = running.iter_lines()  # keep a reference: a dropped iterator disconnects
            next(lines)  # the first token: it holds the only batch slot now
            with b.stream("POST", url, json=body) as waiting:
                assert waiting.status_code == 200  # accepted: queued behind `running`
                assert_error(post(small, "/v1/completions", body), 429, "limit 1")
                assert next(x for x in lines if x).startswith("data: ")  # still streaming
    # Both streams were closed mid-generation: their requests are aborted, blocks freed.
    assert small.async_engine.wait_idle(timeout=10)
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks
    assert post(small, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_oversized_body_is_413(make_server):
    small = make_server(max_request_bytes=1000)
    r = post(small, "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 2})
    assert_error(r, 413, "2", "limit of 1000")
    assert post(small, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{small.url}/health").status_code == 200


def test_chunked_body_over_the_limit_is_413(make_server):
    small = make_server(max_request_bytes=1000)

    def chunks():  # no Content-Length: sent with Transfer-Encoding: chunked
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'", "max_tokens": 2}'

    r = httpx.post(f"{small.url}/v1/completions", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert_error(r, 413, "limit of 1000")
    assert post(small, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_health_during_generation(server):
    """The event loop stays responsive while the step thread runs forward passes."""
    done = threading.Event()
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}  # long enough to poll
    worker = threading.Thread(target=lambda: (post(server, "/v1/completions", body), done.set()))
    worker.start()
    answered = 0
    while not done.is_set():
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        answered += 1
    worker.join()
    assert answered >= 3
