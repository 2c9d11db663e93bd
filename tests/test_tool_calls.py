"""Tool calling: the Hermes-format parser (whole and streamed in any split), tools in the
prompt for templates that do not take them, and /v1/chat/completions on the tiny random
model through the official client: named and required choices always give calls that parse
and match the tool's parameters, streamed deltas reassemble to the same calls, tool results
in the history, clear errors."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.server.tool_parser import ToolCallStream, parse_tool_calls
from tokenmill.server.tool_prompt import plan_tools, prompt_messages

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TEXT = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
        '\n</tool_call>')


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_parse_whole():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Sure."
    assert calls_of(calls) == [("add", {"a": 1, "b": 2}),
                               ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>")[1] == []


@pytest.mark.parametrize("seed", range(20))
def test_stream_in_any_split_equals_whole(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    stream, content, deltas = ToolCallStream(), "", []
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += new
    assert "<tool" not in content and content.strip() == "Sure."
    calls: dict[int, list[str]] = {}
    for d in deltas:  # as a client reassembles them: the name once, the arguments in pieces
        entry = calls.setdefault(d.index, ["", ""])
        entry[0] += d.function.name or ""
        entry[1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == \
        calls_of(parse_tool_calls(TEXT)[1])
    assert len([d for d in deltas if d.id]) == 2  # one id per call


def test_arguments_stream_before_the_call_closes():
    stream = ToolCallStream()
    _, first = stream.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22222')
    assert first[0].function.name == "add" and first[0].id
    assert "".join(d.function.arguments for d in first).startswith('{"a":')  # 14 held back
    _, rest = stream.feed('2}}\n</tool_call>', final=True)
    args = "".join(d.function.arguments for d in first + rest)
    assert json.loads(args) == {"a": 1, "b": 222222}


def test_text_that_looks_like_a_call_opening_is_not_lost():
    stream = ToolCallStream()
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("box> b", final=True) == ("<toolbox> b", [])


def test_prompt_for_a_template_without_tools():
    plan = plan_tools(TOOLS, "auto", True)
    history = [
        {"role": "user", "content": "sum?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"},
    ]
    out = prompt_messages(history, plan, "{{ messages }}")
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>\n"
                                                 "<tool_response>\n4\n</tool_response>"}
    takes_tools = prompt_messages(history, plan, "{% for t in tools %}{% endfor %}")
    assert takes_tools[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


@pytest.fixture(scope="module")
def client(make_server):
    server = make_server(engine_kwargs={"max_model_len": 512})  # the tools take ~290 tokens
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


def ask(client, **kw):
    return client.chat.completions.create(**{
        "model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "tools": TOOLS, "max_tokens": 150, "temperature": 1.0, **kw})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("choice", ["required", "add"])
def test_forced_calls_always_parse_and_match(client, choice, seed):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                      "function": {"name": choice}}
    r = ask(client, tool_choice=tool_choice, seed=seed, parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    for name, args in calls_of(msg.tool_calls):
        assert choice in ("required", name)
        jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("seed", range(3))
def test_streamed_deltas_reassemble_to_the_same_calls(client, seed):
    whole = ask(client, tool_choice="required", seed=seed).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, tool_choice="required", seed=seed, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    complete = [c for c in calls_of(whole.message.tool_calls or [])]
    assert streamed == complete and finish == whole.finish_reason
    assert complete  # at least one call, even when max_tokens cut a last one short


def test_tool_results_in_the_history(client):
    r = client.chat.completions.create(model="tiny", max_tokens=5, messages=[
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"}], tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_none_leaves_tools_out(client):
    r = ask(client, tool_choice="none", max_tokens=8, seed=0)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="always"), "tool_choice"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "tools.0.function.name"),
])
def test_errors(client, kw, param):
    kw = {"tools": TOOLS, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       **kw)
    assert e.value.body["param"] == param


def test_a_template_that_takes_tools_renders_them(make_server):
    server = make_server()
    tok = server.engine.tokenizer
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                "({{ c.function.arguments.a }}){% endfor %}{% endfor %}")
    expected = "[get_weather][add]<user>2 + 2?<assistant>add(2)<tool>4"
    original, tok.chat_template = tok.chat_template, template
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
            r = c.chat.completions.create(model="tiny", max_tokens=1, tools=TOOLS, messages=[
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}])
    finally:
        tok.chat_template = original
    assert r.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
