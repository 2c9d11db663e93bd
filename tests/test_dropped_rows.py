"""A float weight that runs on the packed GEMM alone keeps only its panels: the engine drops
the row-major copy (half a float model's memory) and rebuilds the rows from the panels for any
call that needs them (kernels/csrc/gemm.cpp tm_unpack_weight, layers/linear.py drop_rows)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import build
from tokenmill.layers import ops
from tokenmill.layers.linear import Linear

pytestmark = [pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here"),
              pytest.mark.skipif(os.environ.get("TOKENMILL_KERNELS") == "0",
                                 reason="TOKENMILL_KERNELS=0: reference ops only")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 45), (64, 64), (5, 3001)])  # partial panels, odd k
@pytest.mark.parametrize("gated", [False, True])
def test_unpack_gives_the_rows_back(kops, dtype, n, k, gated):
    lib = kops.lib
    if gated:
        n = 2 * lib.panel_rows * max(1, n // lib.panel_rows)
    w = torch.randn(n, k).to(dtype)
    assert torch.equal(lib.unpack(lib.pack(w, gated=gated)), w)


def layer_with(kops, w: torch.Tensor, gated: bool = False) -> Linear:
    with ops.building(kops):
        layer = Linear(w.shape[1], [w.shape[0] // 2] * 2 if gated else [w.shape[0]])
    layer.weight.data = w.clone()
    layer.gated = gated
    return layer


@pytest.mark.parametrize("gated", [False, True])
def test_a_dropped_layer_computes_as_before(kops, monkeypatch, gated):
    monkeypatch.setenv("TOKENMILL_GEMM", "packed")  # PyTorch's GEMM never runs: rows unneeded
    torch.manual_seed(0)
    w = torch.randn(4 * kops.lib.panel_rows, 48).to(torch.bfloat16)
    layer = layer_with(kops, w, gated)
    x = torch.randn(3, 48).to(torch.bfloat16)
    before = layer(x)
    assert layer.drop_rows() and layer.rows_dropped
    assert layer.weight.shape == w.shape and layer.weight.untyped_storage().nbytes() == 2
    assert torch.equal(layer(x), before)  # the packed GEMM (a gated layer: rebuilt rows)
    if gated:
        assert torch.equal(before, F.linear(x, w))
    # the reference path (as a fallback takes it) reads rows rebuilt from the panels
    assert torch.equal(ops.TorchOps.linear(kops, x, layer), F.linear(x, w))
    assert torch.equal(layer.rows(), w)
    assert layer.drop_rows()  # once dropped, stays so


def test_rows_stay_where_pytorch_may_run(kops, monkeypatch):
    monkeypatch.setenv("TOKENMILL_GEMM", "torch")
    layer = layer_with(kops, torch.randn(64, 32))
    assert not layer.drop_rows() and layer.weight.untyped_storage().nbytes() == 64 * 32 * 4


def test_the_engine_drops_unshared_rows_and_matches_transformers(tiny_llama, monkeypatch):
    monkeypatch.setenv("TOKENMILL_GEMM", "packed")
    path, hf = tiny_llama
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=4, use_kernels=True)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.rows_dropped for m in linears)
    prompts = random_prompts(3, 4, 12, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 8)


def test_a_tied_lm_head_keeps_its_rows(tmp_path, monkeypatch):
    from tests.conftest import save_tiny_model

    monkeypatch.setenv("TOKENMILL_GEMM", "packed")
    save_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=2,
              use_kernels=True)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.rows_dropped
    assert model.model.layers[0].mlp.down_proj.rows_dropped
