"""A float weight that runs on the packed GEMM alone keeps only its panels: the engine drops
the row-major copy (half a float model's memory) and rebuilds the rows from the panels for any
call that needs them (kernels/csrc/gemm.cpp tm_unpack_weight, layers/linear.py drop_rows); a
tied embedding reads its lookups' rows from the LM head's panels."""

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


def test_unpack_of_chosen_rows(kops):
    lib = kops.lib
    w = torch.randn(70, 33).to(torch.bfloat16)
    packed = lib.pack(w)
    ids = torch.tensor([69, 0, 5, 5, 32, 31])
    assert torch.equal(lib.unpack(packed, ids), w[ids])
    assert lib.unpack(packed, torch.tensor([], dtype=torch.int64)).shape == (0, 33)
    with pytest.raises(ValueError, match=r"row indices in \[0, 70\)"):
        lib.unpack(packed, torch.tensor([3, 70]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_lm_head_drops_its_rows_and_the_embedding_reads_the_panels(tmp_path, monkeypatch,
                                                                          dtype):
    from tests.conftest import save_tiny_model

    monkeypatch.setenv("TOKENMILL_GEMM", "packed")
    hf = save_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    llm = LLM(str(tmp_path), dtype=dtype, max_model_len=64, max_num_seqs=2, use_kernels=True)
    model = llm.engine.runner.model
    embed = model.model.embed_tokens
    assert model.lm_head.weight is embed.weight
    assert model.lm_head.rows_dropped and embed.weight.untyped_storage().nbytes() <= 4
    table = hf.model.embed_tokens.weight.detach().to(getattr(torch, dtype))
    ids = torch.tensor([[3, 0, 17], [table.shape[0] - 1, 3, 8]])
    assert torch.equal(embed(ids), table[ids])
    if dtype == "float32":  # the greedy tokens of transformers, through the panels' rows
        prompts = random_prompts(2, 4, 12, seed=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 6)


def test_a_weight_two_linears_share_keeps_its_rows(kops, monkeypatch):
    from torch import nn

    from tokenmill.layers.linear import drop_row_copies, embedding

    monkeypatch.setenv("TOKENMILL_GEMM", "packed")
    with ops.building(kops):
        model = nn.ModuleDict({"a": Linear(32, [64]), "b": Linear(32, [64]),
                               "head": Linear(32, [96]), "embed": embedding(96, 32),
                               "alone": Linear(64, [64])})
    model["b"].weight = model["a"].weight  # shared by two linears: both keep the rows
    model["head"].weight = model["embed"].weight  # a tied head: its embedding reads panels
    releases = []
    dropped = drop_row_copies(model, lambda: releases.append(1) or True)
    assert not model["a"].rows_dropped and not model["b"].rows_dropped
    assert model["head"].rows_dropped and model["alone"].rows_dropped
    assert dropped == (96 * 32 + 64 * 64) * 4 and len(releases) == 1  # under 8 MiB: at start
