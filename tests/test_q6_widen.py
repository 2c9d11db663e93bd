"""From how many rows Q6_K GEMMs widen their codes on the AVX2 tiles (kernels/q6_widen.py)."""

import json

import pytest
import torch

from tokenmill.kernels import load_cpu_kernels, q6_widen
from tokenmill.kernels.isa import supported_isas


@pytest.fixture(params=supported_isas())
def lib(request):
    lib = load_cpu_kernels(request.param)
    yield lib
    lib.set_q6_widen_rows(32)


def test_same_bits_from_any_row_count(lib):
    """Widened or unpacked, every row's outputs are the same bits (and the reference's)."""
    torch.manual_seed(0)
    n, k = 40, 512  # 3 groups, the last partial
    w = q6_widen.q6_weight(lib, n, k)
    x = torch.randn(70, k).to(torch.bfloat16)
    lib.set_q6_widen_rows(q6_widen.NEVER)
    alone = torch.cat([lib.linear(x[i:i + 1], w, out_fp32=True) for i in range(70)])
    ref = x.float() @ lib.qdequantize(w).T
    assert (alone - ref).abs().max() < 0.05 * ref.abs().max()
    for widen_from in (1, 4, 16, 32, q6_widen.NEVER):
        lib.set_q6_widen_rows(widen_from)
        for m in (2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 64, 65, 70):
            assert torch.equal(lib.linear(x[:m], w, out_fp32=True), alone[:m]), (widen_from, m)


def test_measure_times_both_ways(lib):
    times = q6_widen.measure(lib, nbytes=1 << 20, rounds=1)
    assert times["rows"] == list(q6_widen.ROWS)
    assert all(0 < t < 1 for m in ("widened", "unpacked") for t in times[m])


def test_widening_starts_where_it_wins_from_there_on():
    rows = list(q6_widen.ROWS)  # 4, 8, 16, 32, 64
    def at(widened):
        return {"rows": rows, "widened": widened, "unpacked": [1.0] * len(rows)}
    assert q6_widen.widen_from(at([1.2, 0.9, 0.8, 0.6, 0.7])) == 8
    assert q6_widen.widen_from(at([0.5, 1.2, 0.8, 0.6, 0.7])) == 16  # lost at 8
    assert q6_widen.widen_from(at([0.9, 0.9, 0.97, 0.6, 0.7])) == 32  # within the margin at 16
    assert q6_widen.widen_from(at([0.5, 0.5, 0.5, 0.5, 1.0])) == q6_widen.NEVER


def test_choice_is_measured_once_then_cached(lib, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_Q6_WIDEN_ROWS", raising=False)
    monkeypatch.setattr(type(lib), "q6_widens", property(lambda self: True))
    calls = []

    def fake(lib_, nbytes=None, rounds=2):
        calls.append(1)
        return {"rows": list(q6_widen.ROWS), "widened": [2.0, 2.0, 0.5, 0.5, 0.5],
                "unpacked": [1.0] * 5}

    monkeypatch.setattr(q6_widen, "measure", fake)
    cache = tmp_path / "q6_widen.json"
    assert q6_widen.choose(lib, "cpu", cache) == 16
    assert q6_widen.choose(lib, "cpu", cache) == 16 and len(calls) == 1
    assert q6_widen.choose(lib, "another cpu", cache) == 16 and len(calls) == 2
    cache.write_text(json.dumps({f"cpu|{torch.get_num_threads()} threads": {"rows": [1, 2]}}))
    assert q6_widen.choose(lib, "cpu", cache) == 16 and len(calls) == 3  # malformed: measured


def test_forced_and_builds_that_do_not_widen(lib, tmp_path, monkeypatch):
    monkeypatch.setattr(q6_widen, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv("TOKENMILL_Q6_WIDEN_ROWS", "8")
    assert q6_widen.choose(lib, "cpu", tmp_path / "c.json") == 8
    for bad in ("0", "many", "-4"):
        monkeypatch.setenv("TOKENMILL_Q6_WIDEN_ROWS", bad)
        with pytest.raises(ValueError, match="auto or a row count"):
            q6_widen.choose(lib, "cpu", tmp_path / "c.json")
    monkeypatch.setenv("TOKENMILL_Q6_WIDEN_ROWS", "auto")
    monkeypatch.setattr(type(lib), "q6_widens", property(lambda self: False))
    assert q6_widen.choose(lib, "cpu", tmp_path / "c.json") is None
    assert not (tmp_path / "c.json").exists()


def test_the_first_q6_k_pack_chooses(monkeypatch):
    """KernelOps.pack_quantized asks the planner once a Q6_K weight is packed, not before."""
    from tokenmill.layers.kernel_ops import KernelOps
    from tokenmill.quantization import BlockQuant

    lib = load_cpu_kernels()
    ops = KernelOps(lib)
    asked = []
    monkeypatch.setattr(ops.planner, "choose_q6_widen", lambda: asked.append(1))
    d = torch.full((16, 8), 0.01).half()
    ops.pack_quantized([BlockQuant(torch.zeros(16, 256, dtype=torch.uint8), d, -8 * d, 4)])
    assert not asked
    q6 = (torch.zeros(16, 256, dtype=torch.uint8), torch.ones(16, 16, dtype=torch.int8),
          torch.full((16, 1), 1e-3).half())
    ops.pack_quantized([BlockQuant(torch.zeros(16, 256, dtype=torch.uint8), d, -128 * d, 8,
                                   q6=q6)])
    assert asked == [1]
