"""POST /tokenize and /detokenize (server/tokenize.py) on the tiny GPT-2-tokenizer model: ids
checked against the `tokenizers` library, the chat template applied to messages, round trips,
400s naming the bad field, and --api-key guarding both routes."""

from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer

from tests.conftest import ENGINE_DEFAULTS, EOS

KEY = "sk-tokenize"
TEXT = "Hello world! 你好，世界"


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


@pytest.fixture(scope="module")
def gpt2(fixtures) -> BackendTokenizer:
    return BackendTokenizer.from_file(str(fixtures / "tokenizers" / "gpt2" / "tokenizer.json"))


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_tokens_are_the_tokenizers_and_round_trip(server, gpt2):
    out = ok(server, "/tokenize", {"model": "tiny", "prompt": TEXT, "return_token_strs": True})
    expected = gpt2.encode(TEXT).ids
    assert out["tokens"] == expected and out["count"] == len(expected)
    assert out["max_model_len"] == ENGINE_DEFAULTS["max_model_len"]
    assert out["token_strs"] == [gpt2.id_to_token(i) for i in expected]
    assert out["token_strs"][:2] == ["Hello", "Ġworld"]
    assert ok(server, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": TEXT}
    assert ok(server, "/tokenize", {"prompt": TEXT})["token_strs"] is None


def test_detokenize_keeps_special_tokens(server, gpt2):
    ids = gpt2.encode("end").ids + [gpt2.token_to_id(EOS)]
    assert ok(server, "/detokenize", {"tokens": ids})["prompt"] == "end" + EOS


def test_messages_go_through_the_chat_template(server, gpt2):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    out = ok(server, "/tokenize", {"messages": messages})
    rendered = "<|system|>Be brief.\n<|user|>Hi!\n<|assistant|>"
    assert out["tokens"] == gpt2.encode(rendered).ids
    no_prompt = ok(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_prompt["tokens"] == gpt2.encode(rendered.removesuffix("<|assistant|>")).ids
    assert ok(server, "/detokenize", {"tokens": out["tokens"]})["prompt"] == rendered


def test_special_token_text_in_a_message_stays_text(server, gpt2):
    out = ok(server, "/tokenize", {"messages": [{"role": "user", "content": f"a{EOS}b"}]})
    assert gpt2.token_to_id(EOS) not in out["tokens"]
    assert ok(server, "/tokenize", {"prompt": EOS})["tokens"] == [gpt2.token_to_id(EOS)]


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


@pytest.mark.parametrize("body", [{}, {"prompt": "a", "messages": [{"role": "user",
                                                                      "content": "a"}]}],
                         ids=["neither", "both"])
def test_exactly_one_of_prompt_and_messages(server, body):
    assert_400(post(server, "/tokenize", body), "prompt", "exactly one of prompt", "messages")


def test_bad_tokenize_requests_are_400(server):
    assert_400(post(server, "/tokenize", {"prompt": 5}), "prompt")
    assert_400(post(server, "/tokenize", {"messages": []}), "messages")
    assert_400(post(server, "/tokenize", {"messages": [{"role": "user", "content": "a"}],
                                          "chat_template_kwargs": {"messages": []}}),
               "chat_template_kwargs", "messages")
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]})
    assert_400(r, "messages.0.content", "only text")


@pytest.mark.parametrize("bad", [50257, -1, 10**9])
def test_ids_out_of_vocabulary_are_400(server, bad):
    r = post(server, "/detokenize", {"tokens": [15496, bad]})
    assert_400(r, "tokens", f"tokens.1: token id {bad} is out of vocabulary", "0 to 50256")


def test_detokenize_takes_only_integer_ids(server):
    assert_400(post(server, "/detokenize", {"tokens": ["15496"]}), "tokens")
    assert_400(post(server, "/detokenize", {}), "tokens")


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "a"}),
                                       ("/detokenize", {"tokens": [1]})])
def test_unknown_model_is_model_not_found(server, path, body):
    r = post(server, path, {**body, "model": "gpt-4"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
    assert "`gpt-4` does not exist" in r.json()["error"]["message"]


def test_api_key_guards_both_routes(make_server):
    server = make_server(api_key=KEY)
    for path, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [64]})]:
        for headers in [{}, {"Authorization": "Bearer wrong"}]:
            r = post(server, path, body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "authentication_error"
        r = post(server, path, body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
