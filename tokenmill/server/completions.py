"""POST /v1/completions: one prompt or a batch (text or token ids) to n completions each,
as one JSON response or as Server-Sent Events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.request_stream import RequestFailedError, RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError
from tokenmill.server.logprobs import completion_logprobs
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from tokenmill.server.serving import ServedModel, collect, sampling_params, usage
from tokenmill.server.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    sse,
    until_disconnect,
)
from tokenmill.server.structured import structured_outputs


def _prompts(req: CompletionRequest, model: ServedModel) -> list[dict]:
    p = req.prompt
    if isinstance(p, str):
        return [model.encode(p)]
    if not p:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(p[0], int):
        return [{"prompt_token_ids": p}]
    if isinstance(p[0], str):
        return [model.encode(text) for text in p]
    return [{"prompt_token_ids": ids} for ids in p]


def _check_supported(req: CompletionRequest) -> None:
    unsupported = {"echo": req.echo, "suffix": req.suffix, "logit_bias": req.logit_bias,
                   "best_of": req.best_of not in (None, req.n)}
    for name, value in unsupported.items():
        if value:
            raise APIError(400, f"{name} is not supported by this server", param=name)


async def create_completion(req: CompletionRequest, model: ServedModel, raw: Request) -> Response:
    arrival = time.perf_counter()
    model.check_model(req.model)
    _check_supported(req)
    p = req.prompt
    model.limits.check(req, len(p) if isinstance(p, list) and p and isinstance(p[0], str | list)
                       else 1)
    prompts = await asyncio.to_thread(_prompts, req, model)  # the event loop runs on meanwhile
    for prompt in prompts:
        model.check_length(prompt, req.max_tokens, "prompt")
    constraint, constraint_param = structured_outputs(req)
    params = sampling_params(req, req.max_tokens, req.logprobs, constraint)
    rid, created = random_id("cmpl"), int(time.time())
    stream = await model.start(prompts, params, rid, arrival, constraint_param)
    if req.stream:
        return EventStreamResponse(_events(stream, req, model.name, rid, created))
    try:
        outputs = await until_disconnect(raw.receive, collect(stream))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the requests are aborted
    choices = [
        CompletionChoice(
            index=i * req.n + c.index, text=c.text, finish_reason=c.finish_reason,
            logprobs=completion_logprobs(c) if req.logprobs is not None else None)
        for i, out in enumerate(outputs) for c in out.outputs
    ]
    body = CompletionResponse(id=rid, created=created, model=model.name, choices=choices,
                              usage=usage(outputs))
    return JSONResponse(body.model_dump())


class _ChoiceState:
    """Per streamed choice: how much text the logprob offsets have covered, finish sent."""

    def __init__(self) -> None:
        self.text_offset = 0
        self.finished = False


def _chunk(out: RequestOutput, base: int, req: CompletionRequest,
           states: dict[int, _ChoiceState]) -> list[CompletionChoice]:
    choices = []
    for c in out.outputs:
        state = states.setdefault(base + c.index, _ChoiceState())
        finishing = c.finish_reason is not None and not state.finished
        wants_logprobs = req.logprobs is not None and c.delta_token_ids
        if not (c.delta_text or finishing or wants_logprobs):
            continue
        logprobs = None
        if req.logprobs is not None:
            start = len(c.token_ids) - len(c.delta_token_ids)
            logprobs = completion_logprobs(c, start, state.text_offset)
            state.text_offset += sum(len(t) for t in logprobs.tokens)
        state.finished = state.finished or finishing
        choices.append(CompletionChoice(index=base + c.index, text=c.delta_text,
                                        logprobs=logprobs, finish_reason=c.finish_reason))
    return choices


async def _events(stream: RequestStream, req: CompletionRequest, model: str, rid: str,
                  created: int) -> AsyncGenerator[str, None]:
    states: dict[int, _ChoiceState] = {}
    final: dict[str, RequestOutput] = {}
    try:
        async for out in stream:
            base = stream.request_ids.index(out.request_id) * req.n
            choices = _chunk(out, base, req, states)
            if out.finished:
                final[out.request_id] = out
            if choices:
                yield sse(CompletionResponse(id=rid, created=created, model=model,
                                             choices=choices).model_dump())
        if req.include_usage:
            outputs = [final[r] for r in stream.request_ids]
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                         usage=usage(outputs)).model_dump())
    except RequestFailedError as e:
        yield sse(APIError(500, str(e)).body())
    finally:
        stream.close()
    yield sse("[DONE]")
