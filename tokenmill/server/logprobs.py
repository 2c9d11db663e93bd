"""Engine logprobs (token id -> Logprob per generated position) in the two OpenAI shapes:
the legacy completions lists and chat's per-token objects."""

from __future__ import annotations

from tokenmill.outputs import CompletionOutput, Logprob
from tokenmill.server.protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    TopLogprob,
)


def _positions(c: CompletionOutput, start: int):
    """(chosen Logprob, all entries) for the tokens of c from index start on."""
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        yield entry[token_id], entry


def completion_logprobs(c: CompletionOutput, start: int = 0,
                        text_offset: int = 0) -> CompletionLogprobs:
    """Like vLLM, top_logprobs also holds the sampled token. text_offset is where the first
    listed token starts in the completion text."""
    out = CompletionLogprobs()
    for chosen, entry in _positions(c, start):
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        out.text_offset.append(text_offset)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
        text_offset += len(text)
    return out


def _top(lp: Logprob) -> TopLogprob:
    text = lp.decoded_token or ""
    return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))


def chat_logprobs(c: CompletionOutput, num_top: int, start: int = 0) -> ChatLogprobs:
    content = []
    for chosen, entry in _positions(c, start):
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(ChatLogprobToken(**_top(chosen).model_dump(),
                                        top_logprobs=[_top(lp) for lp in top[:num_top]]))
    return ChatLogprobs(content=content)
