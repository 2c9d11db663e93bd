"""StructuredOutputsParams: what a request's output must match (vLLM's names): a JSON schema,
any JSON object, a regular expression, one of a list of strings, or a grammar (Lark, or
llama.cpp's GBNF). `grammar()` turns it into an llguidance grammar, which engine/structured.py
compiles against the model's tokenizer; errors name the field and the problem."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# Separators of json.dumps. llguidance's default lets the model put any whitespace between
# tokens; a small model sampling at temperature 0.8 then sometimes emits newlines until
# max_tokens. A schema's own "x-guidance" options (e.g. {"whitespace_flexible": true}) win.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), regex, choice (a list of
    strings), grammar (Lark, or GBNF with `::=` rules), json_object=True (any JSON object).
    whitespace_flexible lets JSON output use any whitespace between tokens."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_) or 'none'}")
        self.kind = set_[0]
        if self.kind == "json" and isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.kind == "json" and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        if self.kind == "choice" and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if self.kind == name and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From vLLM's structured_outputs object (its disable_any_whitespace is accepted:
        compact JSON is already the default)."""
        values = dict(values)
        if values.pop("disable_any_whitespace", None) is False:
            values.setdefault("whitespace_flexible", True)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        return cls(**values)

    def grammar_spec(self) -> str:
        """The llguidance grammar (a string the matcher compiles); ValueError when the
        grammar text itself cannot be read (compile errors come from engine/structured.py)."""
        import llguidance  # imported on first use: only constrained requests need it

        if self.kind in ("json", "json_object"):
            schema = closed_objects(self.json) if self.kind == "json" else {"type": "object"}
            defaults = {"whitespace_flexible": True} if self.whitespace_flexible else JSON_DEFAULTS
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.choice)
        try:
            return llguidance.grammar_from("grammar", self.grammar)
        except Exception as e:  # the GBNF converter raises plain Exceptions
            raise ValueError(f"structured_outputs.grammar: {e}") from None


def closed_objects(schema):
    """The schema with `additionalProperties: false` on every object schema that lists its
    properties and says nothing about others (xgrammar's strict mode, vLLM's default, and what
    OpenAI's strict mode requires). Without it a small model, free to add keys, sometimes
    invents them until max_tokens."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema
            and "unevaluatedProperties" not in schema):
        out["additionalProperties"] = False
    return out
