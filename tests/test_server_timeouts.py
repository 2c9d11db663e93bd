"""Stalled connections are closed (server/connections.py): one that sends nothing, one that
sends part of its headers (408 first), one whose body stalls; hundreds of them together. A
request that arrives in time is served, and a response that takes longer than the timeout
(a stream) is never cut."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.conftest import LiveServer

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(make_engine):
    from tokenmill.server.app import create_app

    live = LiveServer(create_app(make_engine(), served_model_names=["tiny"]),
                      request_timeout=TIMEOUT)
    yield live
    live.stop()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10 * TIMEOUT)
    return sock


def closed_after(sock: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closed the connection, and what it sent before."""
    start, received = time.monotonic(), b""
    while chunk := sock.recv(4096):
        received += chunk
    return time.monotonic() - start, received


def test_idle_connection_is_closed(server):
    elapsed, received = closed_after(connect(server))
    assert received == b"" and TIMEOUT * 0.8 < elapsed < 5 * TIMEOUT


def test_half_sent_headers_get_408(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    elapsed, received = closed_after(sock)
    assert received.startswith(b"HTTP/1.1 408") and b"request_timeout" in received
    assert elapsed < 5 * TIMEOUT


def test_trickled_headers_do_not_extend_the_deadline(server):
    """One byte every TIMEOUT / 4 seconds: the header deadline runs from the first byte."""
    sock = connect(server)
    start = time.monotonic()
    try:
        for byte in b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 40:
            sock.sendall(bytes([byte]))
            time.sleep(TIMEOUT / 4)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - start < 4 * TIMEOUT


def test_stalled_body_is_closed(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\ncontent-length: 100\r\n\r\n{\"prompt\": ")
    elapsed, _ = closed_after(sock)
    assert elapsed < 5 * TIMEOUT


def test_many_stalled_connections_all_close_and_the_server_serves(server):
    socks = [connect(server) for _ in range(200)]
    for s in socks[:100]:
        s.sendall(b"GET /health HTTP/1.1\r\n")
    time.sleep(2 * TIMEOUT)
    for i, s in enumerate(socks):
        s.settimeout(3 * TIMEOUT)  # closed_after raises if it is still open by then
        _, received = closed_after(s)
        assert received.startswith(b"HTTP/1.1 408") if i < 100 else received == b""
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_response_longer_than_the_timeout_is_not_cut(make_engine):
    """A 200-token stream from a server with a 0.1 s request timeout completes, and the same
    connection then serves another request."""
    from tokenmill.server.app import create_app

    live = LiveServer(create_app(make_engine(), served_model_names=["tiny"]), request_timeout=0.1)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            start = time.monotonic()
            with client.stream("POST", "/v1/completions", json={
                    "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True,
                    "temperature": 0}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert time.monotonic() - start > 0.1
            assert events[-1] == "data: [DONE]" and len(events) > 100
            assert client.get("/health").status_code == 200
    finally:
        live.stop()
