"""Structured outputs and tool calls with the built-in default model (SmolLM2-135M-Instruct)
through the official `openai` client, sampling at temperature 0.8: 20 varied JSON schemas
(nested objects, enums, arrays, bounded numbers) give parseable JSON that matches; tool calls
with tool_choice="required" always parse; streamed tool-call deltas reassemble to the calls."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.smollm2

S = {"type": "string", "maxLength": 24}


def obj(required=True, **props):
    return {"type": "object", "properties": props,
            **({"required": list(props)} if required else {})}


SCHEMAS = [
    ("a person", obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120})),
    ("a book", obj(title=S, year={"type": "integer", "minimum": 1400, "maximum": 2030},
                   genre={"enum": ["novel", "poetry", "history", "science"]})),
    ("a point", obj(x={"type": "number", "minimum": -10, "maximum": 10},
                    y={"type": "number", "minimum": -10, "maximum": 10})),
    ("a shopping list", obj(items={"type": "array", "items": S, "minItems": 1, "maxItems": 5})),
    ("an address", obj(street=S, city=S, zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    ("a movie review", obj(movie=S, stars={"type": "integer", "minimum": 1, "maximum": 5},
                           recommend={"type": "boolean"})),
    ("a company", obj(name=S, ceo=obj(name=S, age={"type": "integer", "minimum": 18,
                                                   "maximum": 99}))),
    ("a colour", obj(name={"enum": ["red", "green", "blue"]},
                     rgb={"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 255},
                          "minItems": 3, "maxItems": 3})),
    ("the weather", obj(city=S, celsius={"type": "number", "minimum": -50, "maximum": 60},
                        sky={"enum": ["sunny", "cloudy", "rainy", "snowy"]})),
    ("a recipe", obj(dish=S, minutes={"type": "integer", "minimum": 1, "maximum": 600},
                     steps={"type": "array", "items": S, "minItems": 1, "maxItems": 4})),
    ("a pet", obj(kind={"enum": ["cat", "dog", "fish"]}, name=S,
                  vaccinated={"type": "boolean"})),
    ("a flight", obj(origin={"type": "string", "pattern": "^[A-Z]{3}$"},
                     destination={"type": "string", "pattern": "^[A-Z]{3}$"},
                     seats={"type": "integer", "minimum": 1, "maximum": 9})),
    ("a team", obj(team=S, members={"type": "array", "maxItems": 3, "items": obj(
        name=S, role={"enum": ["lead", "dev", "test"]})})),
    ("a product", obj(sku=S, price={"type": "number", "minimum": 0, "maximum": 10000},
                      tags={"type": "array", "items": {"enum": ["new", "sale", "eco"]},
                            "maxItems": 3})),
    ("a student", obj(name=S, grades=obj(math={"type": "integer", "minimum": 0,
                                               "maximum": 100},
                                         art={"type": "integer", "minimum": 0,
                                              "maximum": 100}))),
    ("a yes or no answer", obj(answer={"type": "boolean"}, confidence={
        "type": "number", "minimum": 0, "maximum": 1})),
    ("a city", obj(name=S, population={"type": "integer", "minimum": 0, "maximum": 40000000},
                   capital={"type": "boolean"})),
    ("an event", obj(title=S, date={"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                     online={"type": "boolean"})),
    ("a song", obj(False, title=S, artist=S, seconds={"type": "integer", "minimum": 30,
                                                      "maximum": 900})),
    ("a to-do item", obj(task=S, priority={"enum": ["low", "medium", "high"]},
                         done={"type": "boolean"},
                         owner={"anyOf": [S, {"type": "null"}]})),
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": obj(city=S, unit={
                                          "enum": ["celsius", "fahrenheit"]})}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": obj(a={"type": "number"},
                                                        b={"type": "number"})}},
]


@pytest.fixture(scope="module")
def client(default_model):
    from tests.conftest import LiveServer
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app

    engine = LLMEngine(EngineConfig(model=default_model, max_model_len=2048))
    server = LiveServer(create_app(engine, served_model_names=["smol"]))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        yield c
    server.stop()


def test_twenty_schemas_give_json_that_matches(client):
    def ask(i):
        what, schema = SCHEMAS[i]
        r = client.chat.completions.create(
            model="smol", temperature=0.8, max_tokens=400, seed=i,
            messages=[{"role": "user", "content": f"Describe {what} in JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema,
                                             "strict": True}})
        return r.choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch, as a server sees them
        choices = list(pool.map(ask, range(len(SCHEMAS))))
    for (what, schema), choice in zip(SCHEMAS, choices):
        assert choice.finish_reason == "stop", (what, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def weather(client, **kw):
    return client.chat.completions.create(
        model="smol", temperature=0.8, max_tokens=200, tools=TOOLS, tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], **kw)


@pytest.mark.parametrize("seed", range(6))
def test_required_tool_calls_always_parse(client, seed):
    r = weather(client, seed=seed, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", range(3))
def test_streamed_tool_call_deltas_reassemble(client, seed):
    whole = weather(client, seed=seed).choices[0].message.tool_calls
    parts: dict[int, list[str]] = {}
    for chunk in weather(client, seed=seed, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            p = parts.setdefault(d.index, ["", ""])
            p[0] += d.function.name or ""
            p[1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in (parts[i] for i in sorted(parts))] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
