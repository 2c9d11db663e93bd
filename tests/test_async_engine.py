"""AsyncEngine without HTTP: streaming, abort on close, rejection before streaming, the bounded
waiting queue, and a failing step that errors its batch while the loop serves the rest."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tokenmill.engine.async_engine import AsyncEngine, QueueFullError
from tokenmill.engine.request_stream import EngineStepError
from tokenmill.sampling_params import SamplingParams

POISON = 50000  # first prompt token of requests whose steps the fault injection breaks


@pytest.fixture
def run_engine(make_engine):
    """run_engine(coro_fn, engine_kwargs={}, **async_kwargs): run coro_fn(async_engine) on a
    started AsyncEngine, then shut it down."""
    engines = []

    def run(fn, engine_kwargs=None, **kwargs):
        ae = AsyncEngine(make_engine(**(engine_kwargs or {})), **kwargs)
        engines.append(ae)
        ae.start()
        return asyncio.run(fn(ae))

    yield run
    for ae in engines:
        ae.shutdown()


def assert_no_blocks_held(ae: AsyncEngine) -> None:
    assert ae.wait_idle(timeout=10), "the engine never became idle"
    bm = ae.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not ae.engine.requests
    assert ae.stats["kv_cache_usage"] == 0.0


def test_generate_streams_each_step_and_frees_blocks(run_engine):
    async def main(ae):
        params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3)
        return [out async for out in ae.generate("Hello world", params)]

    outs = run_engine(main)
    assert len(outs) == 12  # one output per decode step, not one at the end
    assert [o.finished for o in outs] == [False] * 11 + [True]
    streamed = [t for o in outs for t in o.outputs[0].delta_token_ids]
    assert streamed == outs[-1].outputs[0].token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text


def test_closing_a_stream_aborts_and_frees_blocks(run_engine):
    async def main(ae):
        stream = await ae.add(["Hello world " * 20], SamplingParams(max_tokens=200,
                                                                     ignore_eos=True))
        first = await anext(stream)
        assert ae.engine.block_manager.num_free_blocks < ae.engine.block_manager.num_blocks
        stream.close()
        assert_no_blocks_held(ae)
        return first

    first = run_engine(main)
    assert not first.finished


def test_bad_prompt_is_rejected_before_streaming(run_engine):
    async def main(ae):
        with pytest.raises(ValueError, match="prompt is 300 tokens but max_model_len is 256"):
            await ae.add([{"prompt_token_ids": [1] * 300}], SamplingParams())
        assert_no_blocks_held(ae)

    run_engine(main)


def test_waiting_queue_is_bounded(run_engine):
    async def main(ae):
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        running = await ae.add(["one"], params)
        await anext(running)  # it holds the only batch slot now
        waiting = await ae.add(["two"], params)
        assert ae.num_waiting == 1
        with pytest.raises(QueueFullError, match="limit 1"):
            await ae.add(["three"], params)
        running.close()
        waiting.close()
        assert_no_blocks_held(ae)

    run_engine(main, engine_kwargs=dict(max_num_seqs=1), max_queued_requests=1)


def test_failed_step_errors_its_batch_and_the_loop_serves_the_rest(run_engine, monkeypatch):
    armed = threading.Event()

    async def main(ae):
        real = ae.engine.runner.execute

        def flaky(scheduled, rows, targets, masks=None):
            if armed.is_set() and any(seq.token_ids[0] == POISON for seq, _ in scheduled):
                raise RuntimeError("injected fault")
            return real(scheduled, rows, targets, masks)

        monkeypatch.setattr(ae.engine.runner, "execute", flaky)
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        poisoned = await ae.add([{"prompt_token_ids": [POISON, 1, 2]}], params)
        await anext(poisoned)  # running, alone in the single batch slot
        healthy = await ae.add(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True))
        assert ae.stats["num_waiting"] == 1  # healthy waits: it is not in the failing batch
        armed.set()
        with pytest.raises(EngineStepError, match="injected fault"):
            async for _ in poisoned:
                pass
        outs = [out async for out in healthy]
        assert len(outs[-1].outputs[0].token_ids) == 5
        assert ae.is_running
        assert_no_blocks_held(ae)

    run_engine(main, engine_kwargs=dict(max_num_seqs=1))
