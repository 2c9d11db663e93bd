"""RequestStream: where one HTTP request's engine outputs arrive, on the event loop, and the
errors that end a stream early. Closing a stream aborts what is still running."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokenmill.outputs import RequestOutput


class RequestFailedError(RuntimeError):
    """The engine aborted the request for a reason of its own (not the client's)."""


class EngineStepError(RequestFailedError):
    """A step failed while this request was in the batch."""


class EngineClosedError(RequestFailedError):
    """The engine shut down (or was not started) before the request finished."""


class RequestStream:
    """The outputs of one or more engine requests added together (one HTTP request: several
    prompts of a batched completion). Iterate it for RequestOutputs; close() aborts whatever is
    still running. Only the event loop thread touches it; the step thread goes through the loop.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future = self.loop.create_future()  # set when the engine has them
        self._abort = abort
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    # ---- called on the event loop, scheduled there by the AsyncEngine step thread ---------
    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def accept(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)

    def reject(self, error: Exception) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(error)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()  # siblings of a failed request must not run on with nobody listening
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort the requests that have not finished; their KV blocks are freed before the next
        step. Safe to call more than once."""
        if self._unfinished:
            self._abort(sorted(self._unfinished))
            self._unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
