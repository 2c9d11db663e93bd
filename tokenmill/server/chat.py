"""POST /v1/chat/completions: messages rendered with the model's chat template, n assistant
replies, as one JSON response or as Server-Sent Events (role first, then content deltas).
With tools, calls in the reply come back as tool_calls (tool_prompt.py, tool_parser.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.chat_encoding import encode_chat
from tokenmill.engine.request_stream import RequestFailedError, RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import MAX_LOGPROBS
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
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
from tokenmill.server.tool_parser import ToolCallStream, parse_tool_calls
from tokenmill.server.tool_prompt import (
    ToolPlan,
    constraint,
    plan_tools,
    prompt_messages,
    template_takes_tools,
)


def _messages(req: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported",
                               param=f"messages.{i}.content")
            content = "".join(part.text or "" for part in content)
        message = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages


def _prompt(req: ChatCompletionRequest, model: ServedModel, tools: ToolPlan | None) -> dict:
    tok = model.tokenizer
    if tok is None or not tok.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions",
                       param="messages")
    messages = prompt_messages(_messages(req), tools, tok.chat_template)
    extra = ({"tools": tools.tools} if tools is not None and tools.in_prompt
             and template_takes_tools(tok.chat_template) else {})
    model.check_text_size(sum(len(m["content"]) for m in messages), "messages")
    model.check_unicode(messages, "messages")
    try:
        ids = encode_chat(tok, messages, req.add_generation_prompt,
                          model.limits.allow_special_in_content, **extra)
    except ValueError as e:
        raise bad_request(e, param="messages") from e
    return {"prompt_token_ids": ids}


def _check_supported(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count for this request (None: no logprobs)."""
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                            f"{req.top_logprobs}", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def create_chat_completion(req: ChatCompletionRequest, model: ServedModel,
                                 raw: Request) -> Response:
    arrival = time.perf_counter()
    model.check_model(req.model)
    logprobs = _check_supported(req)
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    model.limits.check(req)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    output_constraint, constraint_param = structured_outputs(req)
    if constraint(tools) is not None:
        if output_constraint is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the output; it "
                                f"cannot be combined with {constraint_param}",
                           param=constraint_param)
        output_constraint, constraint_param = constraint(tools), "tools"
    prompt = await asyncio.to_thread(_prompt, req, model, tools)  # the loop runs on meanwhile
    model.check_length(prompt, max_tokens, "messages")
    params = sampling_params(req, max_tokens, logprobs, output_constraint)
    rid, created = random_id("chatcmpl"), int(time.time())
    stream = await model.start([prompt], params, rid, arrival, constraint_param)
    parse = tools is not None and tools.choice != "none"
    if req.stream:
        return EventStreamResponse(_events(stream, req, model.name, rid, created, parse))
    try:
        outputs = await until_disconnect(raw.receive, collect(stream))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in outputs[0].outputs:
        content, calls = parse_tool_calls(c.text) if parse else (c.text, [])
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        choices.append(ChatChoice(
            index=c.index, message=AssistantMessage(content=content, tool_calls=calls or None),
            finish_reason=finish,
            logprobs=chat_logprobs(c, logprobs) if logprobs is not None else None))
    body = ChatCompletionResponse(id=rid, created=created, model=model.name, choices=choices,
                                  usage=usage(outputs))
    return JSONResponse(body.model_dump())


def _choices(out: RequestOutput, req: ChatCompletionRequest, finished: set[int],
             tool_streams: dict[int, ToolCallStream] | None) -> list[ChatStreamChoice]:
    choices = []
    for c in out.outputs:
        finishing = c.finish_reason is not None and c.index not in finished
        text, calls, finish = c.delta_text, None, c.finish_reason
        if tool_streams is not None:
            parser = tool_streams.setdefault(c.index, ToolCallStream())
            text, calls = parser.feed(c.delta_text, final=finishing)
            if parser.calls and finish == "stop":
                finish = "tool_calls"
        wants_logprobs = req.logprobs and c.delta_token_ids
        if not (text or calls or finishing or wants_logprobs):
            continue
        logprobs = None
        if req.logprobs:
            start = len(c.token_ids) - len(c.delta_token_ids)
            logprobs = chat_logprobs(c, req.top_logprobs or 0, start)
        if finishing:
            finished.add(c.index)
        choices.append(ChatStreamChoice(
            index=c.index, delta=DeltaMessage(content=text or None, tool_calls=calls or None),
            logprobs=logprobs, finish_reason=finish))
    return choices


async def _events(stream: RequestStream, req: ChatCompletionRequest, model: str, rid: str,
                  created: int, parse_tools: bool = False) -> AsyncGenerator[str, None]:
    def chunk(choices, usage_=None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                       usage=usage_).model_dump())

    finished: set[int] = set()
    tool_streams = {} if parse_tools else None
    last = None
    try:
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        async for out in stream:
            last = out
            choices = _choices(out, req, finished, tool_streams)
            if choices:
                yield chunk(choices)
        if req.include_usage and last is not None:
            yield chunk([], usage([last]))
    except RequestFailedError as e:
        yield sse(APIError(500, str(e)).body())
    finally:
        stream.close()
    yield sse("[DONE]")
