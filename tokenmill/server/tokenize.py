"""POST /tokenize and /detokenize, as vLLM serves them: a prompt or chat messages to the token
ids the model would see (what a client counts against max_model_len), and token ids to text."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from tokenmill.chat_encoding import encode_chat
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import ChatMessage, OpenAIModel
from tokenmill.server.serving import ServedModel

# variables the chat template renderer sets itself (Tokenizer.apply_chat_template)
_RENDERER_ARGS = {"messages", "add_generation_prompt", "chat_template", "bos_token", "eos_token"}


class TokenizeRequest(OpenAIModel):
    """vLLM's two tokenize requests in one: exactly one of prompt and messages."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    # None: True for a prompt, False for messages (their template writes the BOS), as vLLM
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


def tokenize_routes(model: ServedModel) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        model.check_model(body.model)
        return await asyncio.to_thread(_tokenize, body, model)  # the event loop runs on

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        model.check_model(body.model)
        return await asyncio.to_thread(_detokenize, body, model)

    return router


def _tokenize(req: TokenizeRequest, model: ServedModel) -> TokenizeResponse:
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt (a text) and messages (a chat)",
                       param="prompt")
    tok = _tokenizer(model)
    if req.prompt is not None:
        model.check_unicode([{"content": req.prompt}], "prompt")
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        ids = _encode_messages(req, model)
    strs = [tok.backend.id_to_token(i) for i in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids,
                            token_strs=strs)


def _encode_messages(req: TokenizeRequest, model: ServedModel) -> list[int]:
    tok = model.tokenizer
    if not tok.chat_template:
        raise APIError(400, "this model has no chat template; send a prompt", param="messages")
    kwargs = req.chat_template_kwargs or {}
    clash = sorted(_RENDERER_ARGS & kwargs.keys())
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}",
                       param="chat_template_kwargs")
    messages = [{"role": m.role, "content": _text(m, i)} for i, m in enumerate(req.messages)]
    model.check_unicode(messages, "messages")
    try:
        ids = encode_chat(tok, messages, req.add_generation_prompt,
                          model.limits.allow_special_in_content, **kwargs)
    except ValueError as e:
        raise bad_request(e, param="messages") from e
    if req.add_special_tokens:  # what encode adds around any text (a BOS), once
        added = tok.encode("", add_special_tokens=True)
        ids = ids if ids[:len(added)] == added else added + ids
    return ids


def _text(m: ChatMessage, i: int) -> str:
    if isinstance(m.content, list):
        if any(part.type != "text" for part in m.content):
            raise APIError(400, "only text content parts are supported",
                           param=f"messages.{i}.content")
        return "".join(part.text or "" for part in m.content)
    return m.content or ""


def _detokenize(req: DetokenizeRequest, model: ServedModel) -> DetokenizeResponse:
    tok = _tokenizer(model)
    vocab = tok.vocab_size
    bad = next(((n, t) for n, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens.{bad[0]}: token id {bad[1]} is out of vocabulary (ids are "
                            f"0 to {vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False))


def _tokenizer(model: ServedModel):
    if model.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return model.tokenizer
