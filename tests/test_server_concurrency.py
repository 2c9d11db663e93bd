"""32 concurrent streaming clients, a third of which hang up midway: every other stream
completes in full, the abandoned requests are aborted (they stop generating), and afterwards the
KV cache is empty: kv_cache_usage_perc is 0 and the block manager holds no blocks. A client of a
non-streaming request that hangs up has its request aborted too."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

openai = pytest.importorskip("openai")

NUM_CLIENTS = 32
FULL_TOKENS = 16  # what the clients that stay get
ABANDONED_TOKENS = 200  # what a client that hangs up asked for: it must never all be made
READ_BEFORE_HANGING_UP = 3


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


async def one_client(client, i: int) -> tuple[str, int]:
    hangs_up = i % 3 == 0
    stream = await client.completions.create(
        model="tiny", prompt=f"Client {i} says hello", stream=True, seed=i,
        max_tokens=ABANDONED_TOKENS if hangs_up else FULL_TOKENS,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = 0
    async for chunk in stream:
        if chunk.choices:
            chunks += 1
        if hangs_up and chunks == READ_BEFORE_HANGING_UP:
            await stream.close()  # closes the connection mid-stream
            return "hung up", chunks
        if chunk.usage is not None:
            return chunk.choices[0].finish_reason if chunk.choices else "done", \
                chunk.usage.completion_tokens
    return "no usage", chunks


async def run_clients(url: str) -> list[tuple[str, int]]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                  timeout=120) as client:
        return await asyncio.gather(*(one_client(client, i) for i in range(NUM_CLIENTS)))


def test_many_streams_with_disconnects_leave_no_blocks(server):
    before = server.metrics()
    results = asyncio.run(run_clients(server.url))
    stayed = [r for i, r in enumerate(results) if i % 3]
    hung_up = [r for i, r in enumerate(results) if i % 3 == 0]
    assert stayed == [("done", FULL_TOKENS)] * len(stayed)
    assert hung_up == [("hung up", READ_BEFORE_HANGING_UP)] * len(hung_up)

    assert server.async_engine.wait_idle(timeout=30), "requests still in the engine"
    bm = server.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    after = server.metrics()
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    assert after["tokenmill:num_requests_running"] == 0.0
    assert after["tokenmill:num_requests_waiting"] == 0.0
    generated = (after["tokenmill:generation_tokens_total"]
                 - before.get("tokenmill:generation_tokens_total", 0.0))
    # Abandoned requests were aborted long before their 200 tokens.
    assert generated < len(stayed) * FULL_TOKENS + len(hung_up) * ABANDONED_TOKENS / 4
    finished = (after["tokenmill:e2e_request_latency_seconds_count"]
                - before.get("tokenmill:e2e_request_latency_seconds_count", 0.0))
    assert finished == len(stayed)  # aborted requests never finish


def test_hanging_up_on_a_non_streaming_request_aborts_it(server, monkeypatch):
    first_token = threading.Event()
    observe = server.async_engine.on_output

    def watch(out):
        first_token.set()
        observe(out)

    monkeypatch.setattr(server.async_engine, "on_output", watch)
    before = server.metrics()
    body = json.dumps({"prompt": "hi", "max_tokens": 200, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        assert first_token.wait(timeout=30), "the request never started"
    assert server.async_engine.wait_idle(timeout=30)
    after = server.metrics()
    finished = (after["tokenmill:e2e_request_latency_seconds_count"]
                - before["tokenmill:e2e_request_latency_seconds_count"])
    assert finished == 0  # aborted, not run to its 200 tokens
    assert server.engine.block_manager.num_free_blocks == server.engine.block_manager.num_blocks
