"""A request's output constraint from its HTTP fields: OpenAI's response_format (text,
json_object, json_schema), vLLM's structured_outputs object and its older guided_json /
guided_regex / guided_choice / guided_grammar fields. At most one may be set."""

from __future__ import annotations

from tokenmill.server.errors import APIError
from tokenmill.structured_outputs import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from); APIError 400 naming the field."""
    sources = {}
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        sources["response_format"] = lambda: _response_format(fmt)
    if req.structured_outputs is not None:
        sources["structured_outputs"] = lambda: StructuredOutputsParams.from_dict(
            req.structured_outputs)
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            sources[name] = lambda kind=kind, value=value: StructuredOutputsParams(
                **{kind: value})
    if not sources:
        return None, None
    if len(sources) > 1:
        raise APIError(400, f"only one output constraint may be set, got {', '.join(sources)}",
                       param=list(sources)[1])
    (param, build), = sources.items()
    try:
        return build(), param
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def _response_format(fmt: dict) -> StructuredOutputsParams:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("type json_schema needs json_schema: {name, schema: {...}, "
                             "strict}")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"type must be one of text, json_object, json_schema; got {kind!r}")
