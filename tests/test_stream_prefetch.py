"""The bf16 GEMM's prefetch hint for calls of few rows (kernels/stream_prefetch.py)."""

import pytest
import torch

from tokenmill.kernels import load_cpu_kernels, stream_prefetch


@pytest.fixture(scope="module")
def lib():
    lib = load_cpu_kernels()
    if lib is None:
        pytest.skip("no kernel library on this machine")
    yield lib
    lib.set_stream_prefetch(False)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_same_bits_with_either_hint(lib, rows):
    torch.manual_seed(rows)
    w = torch.randn(200, 130).to(torch.bfloat16)  # partial panel, odd pair count
    x = torch.randn(rows, 130).to(torch.bfloat16)
    packed = lib.pack(w, torch.randn(200))
    outs = []
    for nta in (False, True):
        lib.set_stream_prefetch(nta)
        outs.append(lib.linear(x, packed, out_fp32=True))
    assert torch.equal(outs[0], outs[1])
    ref = x.float() @ w.float().T + packed.bias
    assert torch.allclose(outs[0], ref, rtol=1e-4, atol=1e-3)


def test_measure_times_both_hints(lib):
    times = stream_prefetch.measure(lib, nbytes=4 << 20)
    assert set(times) == {"l2", "nta"} and all(0 < t < 1 for t in times.values())


def test_choice_is_measured_once_then_cached(lib, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_STREAM_PREFETCH", raising=False)
    monkeypatch.setattr(lib, "isa", "avx512_bf16")  # a build with the dot-product GEMM
    calls = []

    def fake(lib_, nbytes=None):
        calls.append(1)
        return {"l2": 1.0, "nta": 0.5}

    monkeypatch.setattr(stream_prefetch, "measure", fake)
    cache = tmp_path / "stream_prefetch.json"
    assert stream_prefetch.choose(lib, "cpu", cache) == "nta"
    assert stream_prefetch.choose(lib, "cpu", cache) == "nta" and len(calls) == 1
    monkeypatch.setattr(stream_prefetch, "measure", lambda lib_, nbytes=None: {"l2": 1.0,
                                                                                "nta": 0.97})
    cache.unlink()  # nta within the margin: l2 stays
    assert stream_prefetch.choose(lib, "cpu", cache) == "l2"


def test_forced_and_builds_without_the_dot_gemm(lib, tmp_path, monkeypatch):
    monkeypatch.setattr(stream_prefetch, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv("TOKENMILL_STREAM_PREFETCH", "nta")
    assert stream_prefetch.choose(lib, "cpu", tmp_path / "c.json") == "nta"
    monkeypatch.setenv("TOKENMILL_STREAM_PREFETCH", "l2")
    assert stream_prefetch.choose(lib, "cpu", tmp_path / "c.json") == "l2"
    monkeypatch.setenv("TOKENMILL_STREAM_PREFETCH", "fast")
    with pytest.raises(ValueError, match="auto, l2 or nta"):
        stream_prefetch.choose(lib, "cpu", tmp_path / "c.json")
    monkeypatch.delenv("TOKENMILL_STREAM_PREFETCH")
    monkeypatch.setattr(lib, "isa", "avx2")
    assert stream_prefetch.choose(lib, "cpu", tmp_path / "c.json") == "l2"
    assert not (tmp_path / "c.json").exists()
