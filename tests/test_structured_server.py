"""Output constraints through the HTTP API (tiny random model, official client): OpenAI's
response_format, vLLM's structured_outputs and guided_* fields on completions and chat,
streamed and whole, and 400s that name the field at fault."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 500},
    "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}}, "required": ["id", "ok", "kind"]}
SAMPLE = {"temperature": 1.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def client(make_server):
    server = make_server()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


def chat(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give JSON"}], **SAMPLE, **kw)


@pytest.mark.parametrize("seed", range(3))
def test_response_format_json_schema(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                  "strict": True}}
    r = chat(client, response_format=fmt, seed=seed)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = chat(client, response_format=fmt, seed=seed, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_response_format_json_object(client):
    r = chat(client, response_format={"type": "json_object"}, seed=0,
             extra_body={"max_tokens": 200})
    c = r.choices[0]
    if c.finish_reason == "stop":  # a random model may write one object for ever
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


@pytest.mark.parametrize("body, check", [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": r"\d{3}-[xy]{2}"}, lambda t: re.fullmatch(r"\d{3}-[xy]{2}", t)),
    ({"guided_grammar": 'root ::= "<" ("a" | "b") ">"'}, lambda t: t in ("<a>", "<b>")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"choice": ["one", "two"]}}, lambda t: t in ("one", "two")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "s", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_completions_fields(client, body, check):
    for seed in range(2):
        r = client.completions.create(model="tiny", prompt="Answer:", seed=seed, **SAMPLE,
                                      extra_body=body)
        assert check(r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}}, "response_format", "Invalid type"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown field"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
])
def test_errors_name_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", extra_body=body)
    assert e.value.body["param"] == param and words in e.value.body["message"]
