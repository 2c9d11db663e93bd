"""Limits per request (issue 18): stop lists and prompt counts have caps that answer 400 before
any work is done; a prompt too long to fit is refused before it is tokenized; tokenizing a big
prompt does not stop the event loop; stop ids beyond the vocabulary are refused."""

from __future__ import annotations

import threading
import time

import pytest

from tests.test_server_errors import assert_error, post
from tokenmill.server.serving import RequestLimits


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(limits=RequestLimits(max_stop=4, max_stop_token_ids=8, max_prompts=3))


@pytest.mark.parametrize("body,words,param", [
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(5)]}, ["stop has 5", "at most 4"], "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(9))}, ["stop_token_ids has 9", "at most 8"],
     "stop_token_ids"),
    ({"prompt": ["a", "b", "c", "d"]}, ["prompt has 4 prompts", "at most 3"], "prompt"),
    ({"prompt": [[1], [2], [3], [4]]}, ["prompt has 4 prompts"], "prompt"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, ["stop_token_ids must be in [0, 50257)"],
     "stop_token_ids"),
])
def test_limits_are_400s(server, body, words, param):
    assert_error(post(server, "/v1/completions", {**body, "max_tokens": 2}), 400, *words,
                 param=param)


def test_limits_hold_for_chat_too(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}
    assert_error(post(server, "/v1/chat/completions", body), 400, "stop has 5", param="stop")


def test_at_the_limit_is_served(server):
    r = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2,
                                         "stop": list("wxyz"), "stop_token_ids": list(range(8))})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_prompt_too_long_to_fit_is_refused_before_tokenizing(server):
    limit = server.engine.config.max_model_len * server.engine.tokenizer.max_token_chars
    start = time.perf_counter()
    r = post(server, "/v1/completions", {"prompt": "hello " * 800_000, "max_tokens": 2})
    assert_error(r, 400, "4800000 characters", f"at most {limit}", param="prompt")
    assert time.perf_counter() - start < 10  # tokenizing 4.8 MB took ~4 s here
    messages = [{"role": "user", "content": "x" * (limit + 1)}]
    assert_error(post(server, "/v1/chat/completions", {"messages": messages}), 400,
                 "characters", param="messages")


def test_tokenizing_a_long_text_lets_other_threads_run(server):
    """The server tokenizes in a worker thread; that only frees the event loop if the
    tokenizer releases the GIL (encode_batch does, encode does not: 2 ticks in 1.3 s here)."""
    tok = server.engine.tokenizer
    text = "The mill turns the river into flour, and the flour into bread. " * 20_000
    ticks, done = 0, threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    elapsed = time.perf_counter() - start
    assert ticks > 0.3 * elapsed / 0.0012, (ticks, elapsed)  # the main thread kept running
    medium = text[:20_000]  # above the length where encode switches to encode_batch
    assert tok.encode(medium) == tok.backend.encode(medium).ids
