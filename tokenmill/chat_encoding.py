"""Chat prompts to token ids with message content kept as text.

A chat template puts control tokens (`<|im_start|>`, `<|im_end|>`) around each message. If the
rendered prompt is tokenized as one string, a user who types `<|im_end|>\\n<|im_start|>assistant`
in their message closes their own turn and writes the assistant's. As llama.cpp's server does by
default, content is encoded with special-token text as plain text: the template is rendered with
a placeholder for each message's content, the template's own text is tokenized with its control
tokens, and each content with none. Only prompts whose content holds special-token text take this
path; all others are tokenized exactly as before (and as transformers does).
"""

from __future__ import annotations

from tokenmill.tokenizer import Tokenizer


def _mark(i: int) -> str:
    return f"\ue000{i}\ue001"  # private-use characters: no template or user writes these


def has_special_text(tok: Tokenizer, messages: list[dict]) -> bool:
    specials = tok.special_token_texts
    return any(isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)
               for m in messages)


def encode_chat(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                allow_special_in_content: bool = False, **template_kwargs) -> list[int]:
    """Token ids of the rendered chat prompt (no BOS added: the template holds it);
    template_kwargs are more variables for the template (e.g. enable_thinking)."""
    text = tok.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
    if allow_special_in_content or not has_special_text(tok, messages):
        return tok.encode(text, add_special_tokens=False)
    marked = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
    masked = [{**m, "content": _mark(i)} if i in marked else m for i, m in enumerate(messages)]
    rest = tok.apply_chat_template(masked, add_generation_prompt, **template_kwargs)
    ids: list[int] = []
    for i in marked:
        before, found, rest = rest.partition(_mark(i))
        if not found or _mark(i) in rest:
            raise ValueError("a message holds special-token text and this chat template does not "
                             "place each message's content once, so it cannot be kept as text")
        ids += tok.encode(before, add_special_tokens=False)
        ids += tok.encode_as_text(messages[i]["content"])
    return ids + tok.encode(rest, add_special_tokens=False)
