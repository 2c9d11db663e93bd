"""The OpenAI HTTP schema as pydantic models: completion and chat requests (with vLLM's extra
sampling fields), responses, streaming chunks, usage, models and error bodies."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from tokenmill.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Clients send fields we do not model (user, metadata, ...): ignore them, as OpenAI does.
    model_config = ConfigDict(extra="ignore")


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- requests ---------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False


# Request fields passed to SamplingParams under the same name.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens",
)


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions. top_k, min_p,
    repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output and
    skip_special_tokens are vLLM extensions (send them with the OpenAI client's extra_body).
    Strict types: `max_tokens: true` or `"n": "2"` are errors, not 1 and 2."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    # Output constraints (server/structured.py): OpenAI's, vLLM's, and vLLM's older names.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs=None) -> SamplingParams:
        """SamplingParams from the fields that were sent (None keeps the engine's default);
        raises SamplingParams' ValueError, which names the bad parameter."""
        kwargs = {k: getattr(self, k) for k in _SAMPLING_FIELDS if getattr(self, k) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=structured_outputs, **kwargs)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this answers


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "auto" (default with tools), "none", "required", named
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM extension


# ---- usage and logprobs -----------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


# ---- completion responses ---------------------------------------------------------------------
class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat responses ---------------------------------------------------------------------------
class FunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None  # JSON text


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class AssistantMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict:
        # A delta lists only what it changes, as OpenAI's does: {"content": "..."}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# ---- models -----------------------------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
