"""The README's screenshot of the web chat page: starts `tokenmill serve` (default model), asks
two questions in a headless Chromium (tests/cdp.py), waits for the answers and saves the page.
Needs Chromium: apt-get install -y chromium.

    python benchmarks/web_chat_screenshot.py [--model NAME] [--out docs/images/web-chat.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.cdp import INSTALL_HINT, Browser, find_chromium  # noqa: E402

QUESTIONS = ["What is a KV cache in LLM inference? Answer in two sentences.",
             "Why does it make the second turn of a chat faster?"]


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve --port 0`, and its URL once /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", model, "--port", "0"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()  # "tokenmill serve: 'name' on http://127.0.0.1:PORT/v1"
    if " on http" not in line:
        proc.kill()
        raise RuntimeError(f"tokenmill serve did not start: {line!r}")
    url = line.rsplit(" on ", 1)[1].strip().removesuffix("/v1")
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("tokenmill serve never became healthy")


def ask(page: Browser, question: str, count: int) -> str:
    page.eval(f"""document.getElementById('input').value = {json.dumps(question)};
                  document.getElementById('send').click()""")
    return page.wait_for(f"""(s => s.length >= {count} && s[{count - 1}].textContent)
        (document.querySelectorAll('.message.assistant .stats'))""", timeout=300,
                         what=f"answer {count}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=str(ROOT / "docs" / "images" / "web-chat.png"))
    args = ap.parse_args()
    chromium = find_chromium()
    if chromium is None:
        sys.exit(f"chromium not found: {INSTALL_HINT}")
    proc, url = start_server(args.model)
    try:  # a warm-up request first: the stats shown are then those of a warm server
        httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        with Browser(chromium, width=1200, height=800, timeout=600) as page:
            page.goto(url + "/")
            page.wait_for("document.getElementById('model').value", what="the model list")
            page.eval("""for (const [id, v] of [['system', 'You are a concise, helpful assistant.'],
                                                ['temperature', '0'], ['max-tokens', '160']]) {
                           document.getElementById(id).value = v; }""")
            for i, question in enumerate(QUESTIONS, 1):
                print(f"{question}\n  {ask(page, question, i)}")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(args.out)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
