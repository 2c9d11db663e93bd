"""SIGTERM with streams in flight (tokenmill serve as a process): within --shutdown-timeout they
finish normally; past it they end with an error event and [DONE], never just cut off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def serve(model: str, shutdown_timeout: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", model, "--port", "0", "--max-model-len",
           "512", "--kv-cache-memory", "8MiB", "--shutdown-timeout", str(shutdown_timeout)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert " on http://" in line, line + proc.stderr.read()
    return proc, line.split(" on ")[1].strip()


@pytest.mark.parametrize("drain", [30.0, 0.0], ids=["drained", "cut"])
def test_sigterm_ends_streams_cleanly(tiny_model, drain):
    proc, base = serve(tiny_model, drain)
    try:
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=60) as r:
            lines = (x for x in r.iter_lines() if x)
            events.append(next(lines))  # generating now
            proc.send_signal(signal.SIGTERM)
            events += list(lines)
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        if drain:  # the request had time to finish
            assert last["choices"][0]["finish_reason"] == "length"
        else:
            assert "error" in last and "shut down" in last["error"]["message"]
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
