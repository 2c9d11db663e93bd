"""AsyncEngine: the asyncio front of LLMEngine for the server. One background thread runs the
step loop for every request; each request group streams its outputs to its own asyncio queue.

LLMEngine is synchronous and not thread-safe, so only the step thread ever touches it: the event
loop sends "add" and "abort" commands through a thread-safe queue, drained before every step,
and outputs come back with loop.call_soon_threadsafe. Forward passes release the GIL, so the
event loop keeps serving HTTP while the model runs.

Given a function that builds the engine, the step thread builds it: then every OpenMP parallel
region of the process (loading, packing, steps) comes from one thread. A second thread with
its own OpenMP team makes libgomp count more busy-waiting threads than cores and throttle its
spinning: decode steps measured ~1.5x slower when the engine was built in another thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request_stream import EngineClosedError, EngineStepError, RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class QueueFullError(RuntimeError):
    """The waiting queue already holds max_queued_requests requests (HTTP 429)."""


@dataclass
class _Add:
    stream: RequestStream
    prompts: list
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()


class AsyncEngine:
    """Owns an LLMEngine and the thread that steps it.

    max_queued_requests bounds the requests that wait to be scheduled (QueueFullError beyond).
    on_output, if given, is called in the step thread with every RequestOutput (metrics).
    """

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        max_queued_requests: int | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self._go = threading.Event()  # start() lets the step thread run its loop
        self._thread: threading.Thread | None = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
        else:  # build it on the step thread, which then waits for start()
            self.engine = self._build_on_step_thread(engine)
        self.max_queued_requests = max_queued_requests
        self.on_output = on_output
        self.stats: dict = self.engine.stats()  # snapshot published by the step thread
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # step thread only
        self._in_transit = 0  # requests sent to the step thread, not yet acknowledged
        self._ids = itertools.count()
        self._idle = threading.Event()

    # ---- lifecycle ----------------------------------------------------------------------------
    def _build_on_step_thread(self, build: Callable[[], LLMEngine]) -> LLMEngine:
        built: dict = {}
        ready = threading.Event()

        def run() -> None:
            try:
                built["engine"] = build()
            except BaseException as e:  # re-raised in the constructing thread
                built["error"] = e
            ready.set()
            if "engine" in built:
                self._go.wait()
                if self._thread is not None:
                    self._loop()

        self._thread = threading.Thread(target=run, name="tokenmill-step", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in built:
            self._thread.join()
            self._thread = None
            raise built["error"]
        return built["engine"]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokenmill-step", daemon=True)
            self._thread.start()
        self._go.set()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._go.set()
            self._thread.join()
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._go.is_set() and self._thread is not None and self._thread.is_alive()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the engine holds no requests (for tests and shutdown); False on timeout."""
        return self._idle.wait(timeout)

    @property
    def num_waiting(self) -> int:
        return self.stats["num_waiting"] + self._in_transit

    # ---- requests (event loop side) ----------------------------------------------------------
    async def add(
        self,
        prompts: list,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Add one engine request per prompt and wait until the step thread accepted them.
        Raises QueueFullError, or the engine's ValueError for a bad prompt (nothing is added)."""
        if not self.is_running:
            raise EngineClosedError("the engine is not running")
        limit = self.max_queued_requests
        if limit is not None and self.num_waiting + len(prompts) > limit:
            raise QueueFullError(
                f"too many requests waiting ({self.num_waiting}, limit {limit}); retry later"
            )
        base = request_id or f"req-{next(self._ids)}"
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        stream = RequestStream(ids, self.abort)
        self._in_transit += len(ids)
        self._commands.put(_Add(stream, prompts, params, arrival_time or time.perf_counter()))
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            self.abort(ids)  # queued behind the add, so it cannot miss it
            stream.accepted.add_done_callback(_consume)
            raise
        finally:
            self._in_transit -= len(ids)
        return stream

    async def generate(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutput each step it gets new tokens. Closing the generator
        early aborts the request and frees its KV blocks; wrap it in contextlib.aclosing() so
        that a `break` closes it at once rather than when it is garbage collected."""
        stream = await self.add([prompt], params or SamplingParams(), request_id)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(list(request_ids)))

    # ---- the step thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._drain(block=idle):
                self._close_all()
                getattr(self.engine, "close", lambda: None)()  # TP ranks: told on this thread
                return
            self.stats = self.engine.stats()
            if self.engine.has_unfinished_requests():
                self._step()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; wait for one first when there is nothing to step.
        False when asked to stop."""
        if block:
            if self._commands.empty():
                self._idle.set()
            command = self._commands.get()
        else:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        while True:
            if command is _STOP:
                return False
            try:
                self._apply(command)
            except Exception:  # never let one bad command kill the loop
                logger.exception("engine command failed: %r", command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            for rid in command.request_ids:
                self._streams.pop(rid, None)
                self.engine.abort_request(rid)
            return
        stream, added = command.stream, []
        self._idle.clear()
        try:
            for rid, prompt in zip(stream.request_ids, command.prompts):
                self.engine.add_request(rid, prompt, command.params, command.arrival_time)
                added.append(rid)
        except Exception as e:
            for rid in added:
                self.engine.abort_request(rid)
            self._call(stream, stream.reject, e)
            return
        for rid in added:
            self._streams[rid] = stream
        self.stats = self.engine.stats()  # before the ack, so num_waiting never misses them
        self._call(stream, stream.accept)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            self._fail_batch(e)
            self.stats = self.engine.stats()
            return
        self.stats = self.engine.stats()  # before the outputs: a reader of one sees the other
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if self.on_output is not None:
                try:
                    self.on_output(out)
                except Exception:
                    logger.exception("on_output callback failed")
            if stream is not None:
                self._call(stream, stream.put, out)

    def _fail_batch(self, error: Exception) -> None:
        """A failed step leaves the sequences it scheduled in an unknown state, so abort every
        request with a running sequence (all of them if none runs: the loop must progress) and
        tell their clients; waiting requests keep their place."""
        running = {seq.request_id for seq in self.engine.scheduler.running}
        affected = running or set(self.engine.requests)
        message = f"engine step failed: {type(error).__name__}: {error}"
        for rid in sorted(affected):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s after a failed step failed", rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._call(stream, stream.put, EngineStepError(message))

    def _close_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            self._call(stream, stream.put, EngineClosedError("the engine shut down"))
        self._streams.clear()
        self.stats = self.engine.stats()

    def _call(self, stream: RequestStream, fn, *args) -> None:
        """Run fn on the stream's event loop; a closed loop means nobody listens: abort."""
        try:
            stream.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            for rid in stream.request_ids:
                self._streams.pop(rid, None)
                self.engine.abort_request(rid)


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # mark a rejection nobody awaits any more as retrieved
