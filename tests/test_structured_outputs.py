"""Structured outputs in the engine (tiny random Llama, GPT-2 tokenizer): every kind of
constraint yields text that matches it, alone, batched with unconstrained requests (which
keep exactly the tokens they would have alone), with n > 1, with speculative decoding on,
and bad constraints are refused before anything is queued."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tokenmill.layers.sampler import GrammarMasks, apply_grammar
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_outputs import StructuredOutputsParams, closed_objects

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def run(engine, prompts, params_list):
    ids = [engine.add_request(None, p, params) for p, params in zip(prompts, params_list)]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def constrained(so, seed, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 120,
                             "structured_outputs": so, **kw})


def test_json_schema_outputs_parse_and_match(engine):
    outs = run(engine, ["Hello"] * 6, [constrained({"json": SCHEMA}, s) for s in range(6)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.token_ids[-1] != engine.eos_token_ids[0] or c.text.endswith("}")


def test_regex_choice_and_grammars(engine):
    cases = [
        ({"regex": r"[a-c]{2,4}-\d{3}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{3}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'start: "x" ("y" | "z")+ "!"'},  # Lark
         lambda t: re.fullmatch(r"x[yz]+!", t)),
        ({"grammar": 'root ::= "(" [0-9] [0-9]? ")"'},  # GBNF
         lambda t: re.fullmatch(r"\(\d\d?\)", t)),
    ]
    for so, ok in cases:
        for seed in range(3):
            (out,) = run(engine, ["Once"], [constrained(so, seed, max_tokens=60)])
            text = out.outputs[0].text
            assert ok(text) and out.outputs[0].finish_reason == "stop", (so, text)


def test_unconstrained_neighbours_keep_their_tokens(engine):
    free = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
            for i in range(3)]
    alone = run(engine, ["a", "b c", "d e f"], free)
    mixed = run(engine, ["a", "x", "b c", "y", "d e f"],
                [free[0], constrained({"json": SCHEMA}, 1), free[1],
                 constrained({"choice": ["yes", "no"]}, 2), free[2]])
    assert [o.outputs[0].token_ids for o in alone] == \
        [mixed[i].outputs[0].token_ids for i in (0, 2, 4)]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)
    assert mixed[3].outputs[0].text in ("yes", "no")


def test_every_child_of_n_is_constrained(engine):
    (out,) = run(engine, ["Hi"], [constrained({"json": SCHEMA}, 5, n=3)])
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_min_tokens_cannot_force_past_a_complete_grammar(engine):
    (out,) = run(engine, ["Hi"], [constrained({"choice": ["ok"]}, 0, min_tokens=5)])
    assert out.outputs[0].text == "ok"


def test_with_speculative_decoding(make_engine):
    from tokenmill.spec_decode import SpeculativeConfig

    eng = make_engine(speculative_config=SpeculativeConfig(method="ngram",
                                                           num_speculative_tokens=3))
    outs = run(eng, ["Hello Hello Hello"] * 3, [constrained({"json": SCHEMA}, s)
                                                for s in range(3)])
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("so, words", [
    ({"json": {"type": "objekt"}}, "Invalid type"),
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": 'root ::= "a" | missing'}, "missing"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_bad_constraints_are_refused_before_queueing(engine, so, words):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        engine.add_request(None, "hi", SamplingParams(structured_outputs=so))
    assert words in str(e.value)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("values, words", [
    ({}, "exactly one"), ({"json": {}, "regex": "a"}, "exactly one"),
    ({"choice": []}, "non-empty list"), ({"jsn": {}}, "unknown field"),
])
def test_params_validation(values, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(structured_outputs=values)


def test_closed_objects_only_where_unsaid():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object", "properties": {},
                                                     "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_apply_grammar_matches_a_plain_mask():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=g)
    allowed = torch.rand(2, 70, generator=g) > 0.5
    allowed[:, 64:] = False  # beyond the bitmask's 64 tokens: never allowed
    words = torch.zeros(2, 2, dtype=torch.int64)
    for r in range(2):
        for t in range(64):
            words[r, t // 32] |= int(allowed[r, t]) << (t % 32)
    bitmask = words.to(torch.int32)  # wraps bit 31 into the sign, as llguidance writes it
    out = logits.clone()
    apply_grammar(out, logits, GrammarMasks([1, 3], bitmask))
    expected = logits.clone()
    expected[1] = logits[1].masked_fill(~allowed[0], -float("inf"))
    expected[3] = logits[3].masked_fill(~allowed[1], -float("inf"))
    assert torch.equal(out, expected)


def test_grammar_wins_over_bans():
    raw = torch.zeros(1, 40)
    banned = raw.clone()
    banned[0, 7] = -float("inf")  # what min_tokens does to EOS
    bitmask = torch.tensor([[1 << 7, 0]], dtype=torch.int32)  # only token 7 allowed
    apply_grammar(banned, raw, GrammarMasks([0], bitmask))
    assert int(banned.argmax()) == 7 and torch.isinf(banned[0, :7]).all()


def test_params_kinds():
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputsParams.from_dict({"json_object": True}).kind == "json_object"
