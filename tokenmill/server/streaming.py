"""Server-Sent Events, and noticing clients that go away.

A client that disconnects must have its request aborted at once, streaming or not, so both kinds
of response run their work next to a watcher of the ASGI receive channel and cancel the work when
it reports http.disconnect (this does not depend on the web framework doing it for us).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await work; if the client disconnects first, cancel it (its cleanup aborts the engine
    requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def sse(data: dict | str) -> str:
    """One SSE event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


class EventStreamResponse(StreamingResponse):
    """Streams text/event-stream events from an async generator. The generator is always
    closed when the response ends (finished, failed or disconnected), so its `finally` runs
    right away rather than whenever it is garbage collected."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self._pump(send))
        except (ClientDisconnected, OSError):
            pass  # nobody is listening; the events' cleanup has aborted the request
        finally:
            await self.events.aclose()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
