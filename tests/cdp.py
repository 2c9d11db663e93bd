"""A headless Chromium driven through the DevTools protocol over --remote-debugging-pipe, with
the standard library only: for the web chat test and benchmarks/web_chat_screenshot.py."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

INSTALL_HINT = "install it with: apt-get install -y chromium"


def find_chromium() -> str | None:
    names = (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome")
    return next((path for name in names if name and (path := shutil.which(name))), None)


class Browser:
    """One headless Chromium with one page. Every call has a deadline, and the whole browser
    is killed `timeout` seconds after it starts whatever the caller is doing: a hung page ends
    the test with an error instead of hanging it. Use it as a context manager."""

    def __init__(self, binary: str, width: int = 1200, height: int = 800,
                 timeout: float = 120.0) -> None:
        self.profile = tempfile.mkdtemp(prefix="tokenmill-chromium-")
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--hide-scrollbars", "about:blank"]
        self.log = Path(self.profile) / "stderr.log"
        self.proc, self._in, self._out = _launch([binary, *args], self.log)
        self.timeout = timeout
        self._killer = threading.Timer(timeout, self.kill)
        self._killer.daemon = True
        self._killer.start()
        self._buffer, self._next_id, self.session = b"", 0, None
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target,
                                     flatten=True)["sessionId"]
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, method: str, timeout: float = 30.0, **params) -> dict:
        """Send one command (to the page once attached) and return its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._out, data):]
        except BrokenPipeError:
            raise self._exited() from None
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:  # anything else is an event: not needed
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error'].get('message')}")
                return reply["result"]

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise self._exited()
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _exited(self) -> RuntimeError:
        status = self.proc.wait(timeout=10)
        if status == -signal.SIGKILL:
            return RuntimeError(f"Chromium was killed: its {self.timeout:.0f} s limit is up")
        tail = self.log.read_text(errors="replace").splitlines()[-5:]
        return RuntimeError(f"Chromium exited (status {status}):\n" + "\n".join(tail))

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(details.get("exception", {}).get("description") or details)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, what: str = ""):
        """Poll until the expression is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.eval(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what or expression}")
            time.sleep(0.05)
        return value

    def goto(self, url: str) -> None:
        result = self.call("Page.navigate", url=url)  # answers once the new page commits
        if result.get("errorText"):
            raise RuntimeError(f"cannot load {url}: {result['errorText']}")
        self.wait_for("document.readyState === 'complete'", what=f"{url} to load")

    def screenshot(self, path: str | Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self._killer.cancel()
        self.kill()
        if self.proc.returncode is None:
            self.proc.wait(timeout=10)
            os.close(self._in)
            os.close(self._out)
            shutil.rmtree(self.profile, ignore_errors=True)


def _launch(command: list[str], log: Path) -> tuple[subprocess.Popen, int, int]:
    """Start Chromium with --remote-debugging-pipe: it reads commands on fd 3 and writes
    replies and events on fd 4. Returns it and our ends (to read from, to write to)."""
    commands, to_chromium = os.pipe()
    from_chromium, replies = os.pipe()
    # Popen cannot renumber fds (and a preexec_fn is unsafe in a threaded process), so bash
    # (not sh: dash refuses fds above 9) copies the pipe ends to 3 and 4; replies, made second
    # with 0-2 taken, is never fd 3, so the first copy cannot overwrite it. Its own session:
    # killing the group ends the renderer and helper processes too.
    script = f'exec "$0" "$@" 3<&{commands} 4>&{replies}'
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(["bash", "-c", script, *command], pass_fds=(commands, replies),
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr)
    os.close(commands)
    os.close(replies)
    return proc, from_chromium, to_chromium
