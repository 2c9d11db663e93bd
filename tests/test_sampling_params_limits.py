"""Core fixes found while building the server: a seed or top_k that torch cannot hold used to
pass SamplingParams and then fail the engine step of every request batched with it."""

from __future__ import annotations

import httpx
import pytest

from tokenmill.sampling_params import SamplingParams


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_out_of_torch_range_is_rejected_up_front(seed):
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [0, -1, 2**63, 2**64 - 1, -(2**63)])
def test_seeds_torch_accepts_are_fine(seed):
    assert SamplingParams(seed=seed).seed == seed


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


def test_server_rejects_a_huge_seed_with_400(server):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": "hi", "seed": 2**64, "temperature": 1.0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"


def test_top_k_beyond_int64_is_rejected_up_front():
    with pytest.raises(ValueError, match="top_k must be"):
        SamplingParams(top_k=2**70)
    assert SamplingParams(top_k=10**9).top_k == 10**9  # larger than any vocabulary: fine


def test_server_rejects_a_huge_top_k_with_400(server):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": "hi", "top_k": 2**70, "temperature": 1.0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_k"


def test_largest_accepted_values_run_through_the_sampler(server):
    for extra in ({"seed": 2**64 - 1}, {"seed": -(2**63)}, {"top_k": 2**63 - 1}):
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"prompt": "hi", "max_tokens": 2, "temperature": 1.0, **extra})
        assert r.status_code == 200, (extra, r.text)
