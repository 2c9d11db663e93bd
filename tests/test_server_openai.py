"""The server through the official `openai` client: completions and chat, whole and streamed
(the same text either way, for a seed and for greedy), n, batched prompts, logprobs, stop
strings and cached-token usage."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

FIXED = {"ignore_eos": True}  # a random model may sample EOS; fixed lengths keep tests exact


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def stream_text(chunks, index: int = 0) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index == index:
                text += choice.text
                finish = choice.finish_reason or finish
    return text, finish


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion(client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=7,
                                  extra_body=FIXED)
    assert r.object == "text_completion" and r.model == "tiny"
    assert len(r.choices) == 1 and r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 2  # GPT-2: "Hello world" -> [15496, 995]
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == 9
    assert r.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=1234)],
                         ids=["greedy", "seeded"])
def test_streamed_completion_equals_whole(client, sampling):
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=16, extra_body=FIXED,
                  **sampling)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text, finish = stream_text(chunks)
    assert text == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason == "length"
    assert len(chunks) > 2  # streamed as it was made, not in one piece
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=99)],
                         ids=["greedy", "seeded"])
def test_streamed_chat_equals_whole(client, sampling):
    kwargs = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi there!"}],
                  max_completion_tokens=12, extra_body=FIXED, **sampling)
    whole = client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True},
                                                 **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 5  # the chat template's tokens count too


def test_n_and_batched_prompts_index_choices(client):
    r = client.completions.create(model="tiny", prompt=["Hello", "Goodbye"], n=2, seed=5,
                                  max_tokens=4, temperature=1.0, extra_body=FIXED)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    streamed = list(client.completions.create(model="tiny", prompt=["Hello", "Goodbye"], n=2,
                                              seed=5, max_tokens=4, temperature=1.0,
                                              extra_body=FIXED, stream=True))
    by_index = {c.index: c.text for c in r.choices}
    assert {i: stream_text(streamed, i)[0] for i in range(4)} == by_index


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, logprobs=3,
                                  temperature=0.0, extra_body=FIXED)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) >= 3
        assert top[token] == value == max(top.values())  # greedy picks the most likely


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2,
                                       temperature=0.0, extra_body=FIXED)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
               for t in content)


def test_stop_string_ends_the_text(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", temperature=0.0)
    full = client.completions.create(max_tokens=10, extra_body=FIXED, **kwargs).choices[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), f"need a visible stop string from {full!r}"
    r = client.completions.create(max_tokens=10, stop=[stop], **kwargs)
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_usage_counts_prefix_cache_hits(client):
    prompt = " ".join(["one two three four five six seven eight nine ten"] * 4)  # 40 tokens
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens == 40
    assert r.usage.prompt_tokens_details.cached_tokens == 32  # two full 16-token blocks
