"""Tokenizer: encode/decode through the `tokenizers` library, streaming detokenization, and
chat templates rendered in a jinja2 sandbox (templates ship with models: untrusted input)."""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        # True where chat_template is the model family's, given to a file that ships none (a
        # base model's GGUF): `tokenmill generate` then completes the prompt as it is
        self.family_template = False
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        ids = list(eos_token_ids or [])
        if eos_id is not None and eos_id not in ids:
            ids.insert(0, eos_id)
        self.eos_token_ids = ids

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def special_token_texts(self) -> list[str]:
        """The text of every special added token (`<|im_end|>`, ...)."""
        return [t.content for t in self.backend.get_added_tokens_decoder().values()
                if t.special and t.content]

    @functools.cached_property
    def _plain_backend(self) -> BackendTokenizer:
        plain = BackendTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True  # `<|im_end|>` in the input is text, not a token
        return plain

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of text with special-token strings in it encoded as ordinary text."""
        return _encode(self._plain_backend, text, add_special_tokens=False)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: the longest vocabulary entry
        in UTF-8 bytes (byte-level BPE keeps one character per byte, sentencepiece's '▁' and
        '<0x0A>' byte tokens only overestimate). A text longer than n x this cannot be <= n
        tokens, which the server checks before tokenizing it."""
        return max((len(t.encode()) for t in self.backend.get_vocab(with_added_tokens=True)),
                   default=1)

    @classmethod
    def from_folder(cls, path: str) -> Tokenizer | None:
        """A Hugging Face folder's tokenizer.json (+ tokenizer_config.json, chat_template.jinja);
        None when the folder has no tokenizer.json."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            return None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = _read_json(os.path.join(path, "special_tokens_map.json"))
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            BackendTokenizer.from_file(tok_file),
            bos_token=_token_text(cfg.get("bos_token") or special.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token") or special.get("eos_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode(self.backend, text, add_special_tokens)
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of one token for logprob listings (special tokens shown, not skipped)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; pass chat_template= explicitly")
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


def _encode(backend: BackendTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Long texts go through encode_batch, which releases the GIL, so a server thread
    tokenizing a big prompt does not stop the event loop (encode holds it)."""
    if len(text) > 8192:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


def render_chat_template(template: str, messages: list[dict], **kwargs) -> str:
    """Render a Hugging Face chat template the way transformers does (same jinja settings)."""
    try:
        return _ENV.from_string(template).render(messages=messages, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character.

    Decodes a short window of recent tokens twice (without and with the new token) and emits the
    difference, holding it back while the decoded text ends in U+FFFD (an incomplete byte
    sequence). Decoding a window rather than single tokens keeps SentencePiece's leading-space
    rules right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (e.g. truly invalid bytes)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""
