"""What both OpenAI endpoints share: the served model, turning a request into engine prompts
with checked lengths, starting the engine requests (errors become HTTP errors), collecting the
final outputs and counting usage."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.async_engine import AsyncEngine, QueueFullError
from tokenmill.engine.request_stream import EngineClosedError, RequestFailedError, RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import PromptTokensDetails, SamplingRequest, Usage


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (flags of tokenmill serve). Stop strings are checked
    against the new text of every generated token and stop ids against every token, so their
    counts bound the work a request adds to every step; prompts per request bound how long one
    request can occupy the batch ahead of others."""

    max_stop: int = 64
    max_stop_token_ids: int = 1024
    max_prompts: int = 128
    # special-token text in chat message content (`<|im_end|>`) parsed as control tokens
    allow_special_in_content: bool = False

    def check(self, req: SamplingRequest, num_prompts: int = 1) -> None:
        stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
        for name, count, limit in (("stop", len(stop), self.max_stop),
                                   ("stop_token_ids", len(req.stop_token_ids or []),
                                    self.max_stop_token_ids),
                                   ("prompt", num_prompts, self.max_prompts)):
            if count > limit:
                what = "prompts" if name == "prompt" else "entries"
                raise APIError(400, f"{name} has {count} {what}; this server accepts at most "
                                    f"{limit} per request", param=name)


@dataclass
class ServedModel:
    """The engine behind the API and the names clients may call it by (the first is shown)."""

    engine: AsyncEngine
    names: list[str]
    limits: RequestLimits = RequestLimits()

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.max_model_len

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.names:
            raise APIError(404, f"the model `{requested}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.names)}",
                           param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> dict:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token ids",
                           param="prompt")
        self.check_text_size(len(text), param)
        _check_unicode(text, param)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": ids}

    def check_unicode(self, messages: list[dict], param: str) -> None:
        for m in messages:
            _check_unicode(m["content"], param)

    def check_text_size(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit in max_model_len tokens whatever
        it says (no token stands for more than tokenizer.max_token_chars characters)."""
        limit = self.max_model_len * self.tokenizer.max_token_chars
        if chars > limit:
            raise APIError(400, f"{param} is {chars} characters, more than max_model_len "
                                f"({self.max_model_len}) tokens can hold (at most {limit} "
                                f"characters for this tokenizer)", param=param)

    def check_length(self, prompt: dict, max_tokens: int | None, param: str) -> None:
        """Reject what cannot fit in max_model_len, saying how long it is."""
        n, limit = len(prompt["prompt_token_ids"]), self.max_model_len
        if n >= limit:
            raise APIError(400, f"prompt is {n} tokens but max_model_len is {limit}; the prompt "
                                "must leave room for at least one generated token", param=param)
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                                f"{n + max_tokens} tokens exceeds max_model_len ({limit})",
                           param="max_tokens")

    async def start(self, prompts: list[dict], params: SamplingParams, request_id: str,
                    arrival_time: float, constraint_param: str | None = None) -> RequestStream:
        """Start the engine requests. constraint_param: the request field the output
        constraint came from, named when the engine cannot compile it."""
        try:
            return await self.engine.add(prompts, params, request_id, arrival_time)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full") from e
        except EngineClosedError as e:
            raise APIError(503, str(e)) from e
        except ValueError as e:
            if constraint_param and str(e).startswith("structured_outputs"):
                raise APIError(400, f"{constraint_param}: {e}", param=constraint_param) from e
            raise bad_request(e, default_param="prompt") from e


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON allows "\ud800" alone; no tokenizer takes it
        raise APIError(400, f"the text is not valid Unicode: a lone surrogate "
                            f"(U+{ord(text[e.start]):04X}) at character {e.start}",
                       param=param) from None


def sampling_params(req: SamplingRequest, max_tokens: int | None,
                    logprobs: int | None, structured_outputs=None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs, structured_outputs)
    except ValueError as e:
        raise bad_request(e) from e


async def collect(stream: RequestStream) -> list[RequestOutput]:
    """Final outputs of every request in the stream, in prompt order."""
    final: dict[str, RequestOutput] = {}
    try:
        async for out in stream:
            if out.finished:
                final[out.request_id] = out
    except EngineClosedError as e:
        raise APIError(503, str(e)) from e
    except RequestFailedError as e:
        raise APIError(500, str(e)) from e
    finally:
        stream.close()
    return [final[rid] for rid in stream.request_ids]


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(o.num_cached_tokens for o in outputs)))
