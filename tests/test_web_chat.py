"""The web chat page (/) in a real headless Chromium, driven over the DevTools protocol
(tests/cdp.py): an answer streams in and gets its stats line, the next turn sends the whole
conversation (so the prefix cache serves it), Stop aborts the request on the server, and with
--api-key the page loads without the key while its requests need it."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.cdp import INSTALL_HINT, Browser, find_chromium

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason=f"chromium not found: {INSTALL_HINT}")
KEY = "sk-web-chat"
STATS = re.compile(r"TTFT (\d+) ms · ([\d.]+) tok/s · (\d+) tokens · "
                   r"(\d+) of (\d+) prompt tokens cached · cut at max_tokens")
# Records every text the newest answer shows, as the page changes it.
RECORD = """window.seen = []; new MutationObserver(() => {
  const texts = document.querySelectorAll('.message.assistant .text');
  const text = texts.length ? texts[texts.length - 1].textContent : '';
  if (text && text !== window.seen.at(-1)) window.seen.push(text);
}).observe(document.getElementById('log'), {subtree: true, childList: true,
                                            characterData: true})"""


@pytest.fixture
def page():
    with Browser(CHROMIUM, timeout=120) as browser:
        yield browser


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


def fill(page: Browser, element_id: str, value: str) -> None:
    """Set a field as typing would: its input and change events fire."""
    page.eval(f"""(e => {{ e.value = {json.dumps(value)};
        e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change')); }})
        (document.getElementById({json.dumps(element_id)}))""")


def send(page: Browser, text: str) -> None:
    fill(page, "input", text)
    page.eval("document.getElementById('send').click()")


def open_page(page: Browser, url: str, model: str | None = "tiny") -> None:
    page.goto(url + "/")
    if model:
        page.wait_for(f"document.getElementById('model').value === {json.dumps(model)}",
                      what="the model list")


def answer(page: Browser, count: int) -> str:
    """The stats line of the count-th answer once it has one, or "error: <text>" if it failed."""
    return page.wait_for(f"""(m => m.length >= {count} && (m = m[{count - 1}]) &&
        (m.querySelector('.stats')?.textContent ||
         m.classList.contains('error') && 'error: ' + m.textContent))
        (document.querySelectorAll('#log .message:not(.user)'))""", timeout=60,
                         what=f"answer {count} to finish")


def test_answer_streams_in_with_its_stats_and_the_next_turn_hits_the_prefix_cache(
        server, page, monkeypatch):
    # The tiny model writes 40 tokens in a few milliseconds, which can reach the page in one
    # network read and so show as one text change. Paced steps make the stream observable.
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: time.sleep(0.015) or step())
    open_page(page, server.url)
    fill(page, "temperature", "0")
    fill(page, "max-tokens", "40")
    page.eval(RECORD)
    send(page, "Hello there, how are you today?")
    line = answer(page, 1)
    first = STATS.fullmatch(line)
    assert first, line
    seen = page.eval("window.seen")
    assert len(seen) >= 2, seen  # streamed: partial texts showed before the whole answer
    assert all(seen[-1].startswith(s) for s in seen)
    ttft, rate, tokens, cached, prompt = first.groups()
    assert int(tokens) == 40 and float(rate) > 0 and int(ttft) >= 0
    assert int(cached) == 0

    send(page, "And how about tomorrow?")
    line = answer(page, 2)
    second = STATS.fullmatch(line)
    assert second, line
    # The whole conversation was sent: the first prompt and answer are in the second prompt,
    # and the prefix cache served their full blocks.
    assert int(second[5]) > int(prompt) + 40
    assert 0 < int(second[4]) < int(second[5])


def test_stop_aborts_the_request_on_the_server(server, page):
    open_page(page, server.url)
    fill(page, "max-tokens", "200")
    before = server.metrics()
    # Stop as soon as the answer shows text: the remaining ~200 tokens take several steps.
    page.eval("""new MutationObserver((_, observer) => {
        if (document.querySelector('.message.assistant .text')?.textContent) {
          observer.disconnect(); document.getElementById('stop').click(); }
      }).observe(document.getElementById('log'), {subtree: true, childList: true,
                                                  characterData: true})""")
    send(page, "Tell me a long story.")
    line = answer(page, 1)
    assert re.fullmatch(r"TTFT \d+ ms · stopped", line), line
    assert page.eval("document.querySelector('.message.assistant .text').textContent")
    assert page.eval("document.getElementById('send').disabled") is False

    assert server.async_engine.wait_idle(timeout=10), "the request is still in the engine"
    after = server.metrics()
    finished = (after["tokenmill:e2e_request_latency_seconds_count"]
                - before.get("tokenmill:e2e_request_latency_seconds_count", 0.0))
    generated = (after["tokenmill:generation_tokens_total"]
                 - before.get("tokenmill:generation_tokens_total", 0.0))
    assert finished == 0  # aborted: it never reached its end
    assert 0 < generated < 200
    bm = server.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_an_error_from_the_server_is_shown(server, page):
    open_page(page, server.url)
    fill(page, "max-tokens", "1000")
    send(page, "hi")
    assert re.fullmatch(r"error: prompt \(\d+ tokens\) \+ max_tokens \(1000\) = \d+ tokens "
                        r"exceeds max_model_len \(256\)", answer(page, 1))
    assert page.eval("!!document.querySelector('.message.user.unsent')") is True


def test_with_an_api_key_the_page_loads_and_asks_for_the_key(make_server, page):
    keyed = make_server(api_key=KEY)
    for path in ("/", "/static/chat.js", "/static/chat.css"):  # open: no secrets in them
        assert httpx.get(keyed.url + path).status_code == 200, path
    for path in ("/v1/models", "/docs", "/openapi.json"):  # still guarded
        assert httpx.get(keyed.url + path).status_code == 401, path

    open_page(page, keyed.url, model=None)
    notice = page.wait_for("document.getElementById('notice').textContent")
    assert "missing API key" in notice
    send(page, "hi")
    error = answer(page, 1)
    assert "error: missing API key" in error and "Enter the server's API key" in error

    fill(page, "api-key", KEY)  # its change event reloads the model list
    page.wait_for("document.getElementById('model').value === 'tiny'", what="the model list")
    assert page.eval("localStorage.getItem('tokenmill.api-key')") == KEY
    assert page.eval("document.getElementById('input').value") == "hi"  # given back
    fill(page, "max-tokens", "16")
    page.eval("document.getElementById('send').click()")
    line = answer(page, 2)
    assert STATS.fullmatch(line), line
    assert page.eval("document.getElementById('notice').hidden") is True
