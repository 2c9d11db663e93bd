"""Tensor parallelism's failures: a worker killed mid-generation ends the server with a
message, a node that never starts is a clear error after the timeout, and shapes or settings
that do not split are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import save_tiny_model
from tests.test_tensor_parallel import KW, free_port
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine


def test_rendezvous_timeout_is_a_clear_error(tmp_path):
    """Node 0 alone, node 1 never started (in a process of its own: a failed rendezvous
    leaves torch.distributed's group counter behind)."""
    save_tiny_model(tmp_path, "llama")
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill", "generate", str(tmp_path), "hi",
         "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(free_port()),
         "--distributed-timeout", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and time.monotonic() - start < 30
    assert "rendezvous at 127.0.0.1" in r.stderr and "nodes started" in r.stderr


@pytest.mark.parametrize("overrides, words", [
    (dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16),
     "num_attention_heads \\(3\\) is not divisible"),
    (dict(intermediate_size=129), "intermediate_size \\(129\\) is not divisible"),
])
def test_shapes_that_do_not_split(tmp_path, overrides, words):
    save_tiny_model(tmp_path, "llama", **overrides)
    with pytest.raises(ValueError, match=words):
        LLMEngine(EngineConfig(model=str(tmp_path), tensor_parallel_size=2, **KW))


def test_bad_parallel_config():
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(model="x", tensor_parallel_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match="master_port"):
        EngineConfig(model="x", tensor_parallel_size=2, nnodes=2)


def _spawned_children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and "spawn_main" in cmd:
            kids.append(int(entry))
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the worker")
def test_killed_worker_ends_the_server_with_a_message(tmp_path):
    import httpx

    save_tiny_model(tmp_path, "llama")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", str(tmp_path), "--port", str(port),
         "--tensor-parallel-size", "2", "--max-model-len", "256"],
        stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}
        streaming = threading.Thread(target=lambda: _drain(httpx, f"{url}/v1/completions",
                                                           body), daemon=True)
        streaming.start()
        time.sleep(1.0)
        (worker,) = _spawned_children(server.pid)
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        code = server.wait(timeout=20)
        assert code != 0 and time.monotonic() - start < 10
        assert "tensor-parallel worker rank 1" in server.stderr.read()
    finally:
        server.kill()


def _drain(httpx, url, body) -> None:
    try:
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the server went away: what the test causes
