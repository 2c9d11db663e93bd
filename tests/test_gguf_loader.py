"""GGUF model loading: tensor names, Q/K un-permutation, dequantization, config, errors.

Oracles: the original transformers model (F32 files written like llama.cpp's converter does),
transformers loading the same GGUF (gguf_file=), and transformers' own dequantization code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from tests.gguf_util import random_blocks, write_gguf
from tokenmill import LLM
from tokenmill.loaders.gguf import dequantize_tensor, hf_name, load_gguf

transformers = pytest.importorskip("transformers")
IDS = [3, 100, 7, 250, 11, 42, 199, 5]


def tiny(kind: str, tie: bool):
    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    with torch.no_grad():  # transformers initializes biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def hf_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def our_logits(path, ids=IDS) -> torch.Tensor:
    return LLM(str(path), dtype="float32", max_model_len=64,
               max_num_seqs=1).engine.compute_logits(ids)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_float32_file_matches_original_model(tmp_path, arch, tie):
    model = tiny(arch, tie)
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    write_gguf(tmp_path / "m.gguf", arch, model.config, state)
    _, cfg, dtype = load_gguf(str(tmp_path / "m.gguf"), "auto", torch.device("cpu"), 64)
    assert dtype == torch.float32 and cfg.tie_word_embeddings == tie
    assert cfg.attention_bias == (arch == "qwen2") and cfg.num_key_value_heads == 2
    diff = (our_logits(tmp_path / "m.gguf") - hf_logits(model)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_file_loads_the_same_values_without_float32(tmp_path, tie):
    """A BF16 file's matrices go to a bfloat16 model as their bits (gguf.bf16_matrix), not
    through float32 copies: the same parameters as the float32 load rounded (exact here)."""
    model = tiny("llama", tie)
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    types = {s: Q.BF16 for s in ("token_embd.weight", "output.weight", "attn_q.weight",
                                 "attn_k.weight", "attn_v.weight", "attn_output.weight",
                                 "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")}
    write_gguf(tmp_path / "m.gguf", "llama", model.config, state, types)
    ours, _, dtype = load_gguf(str(tmp_path / "m.gguf"), "bfloat16", torch.device("cpu"), 64)
    ref, _, _ = load_gguf(str(tmp_path / "m.gguf"), "float32", torch.device("cpu"), 64)
    assert dtype == torch.bfloat16
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, theirs[name].to(torch.bfloat16)), name
    # the bits as stored (q and k rows un-permuted as for float32)
    assert torch.equal(ours.model.layers[0].mlp.down_proj.weight,
                       model.model.layers[0].mlp.down_proj.weight.to(torch.bfloat16))


QUANT_MIX = {"token_embd.weight": Q.Q8_0, "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q5_K,
             "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q4_0, "ffn_gate.weight": Q.Q4_1,
             "ffn_up.weight": Q.F16, "ffn_down.weight": Q.BF16}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_file_matches_transformers_gguf(tmp_path, arch):
    model = tiny(arch, tie=False)
    write_gguf(tmp_path / "m.gguf", arch, model.config, model.state_dict(), QUANT_MIX)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ref, exact = hf_logits(theirs), hf_logits(theirs.double())
    # the random K-quant blocks make q and k large (~100) and attention nearly one-hot, so float32
    # rounding anywhere before it is amplified: measured against float64, transformers' own
    # float32 logits are off by ~3e-5, ours by 1e-5 to 2e-4 depending on the build's reduction
    # order (RMSNorm over 8 or 16 lanes; qkv_proj alone is within 1e-6 relative on every build).
    hf_error = (ref.double() - exact).abs().max().item()
    ours = (our_logits(tmp_path / "m.gguf").double() - exact).abs().max().item()
    assert ours < max(4e-4 * ref.abs().max().item(), 5 * hf_error)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_matches_transformers(qtype):
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = random_blocks(qtype, 8, 512, rng)
    else:
        data = quantize(rng.normal(size=(8, 512)).astype(np.float32), qtype)
    ours = dequantize_tensor(data, qtype, "t")
    theirs = dequant.dequantize(torch.from_numpy(data.copy()).flatten(), int(qtype))
    assert ours.shape == (8, 512)
    torch.testing.assert_close(ours.flatten(), theirs, rtol=1e-6, atol=1e-7)


# worst-case error of each format for N(0, 1) data, relative to the block's largest value
@pytest.mark.parametrize("qtype,tol", [(Q.F32, 0), (Q.F16, 1e-3), (Q.BF16, 8e-3), (Q.Q8_0, 1e-2),
                                       (Q.Q5_0, 7e-2), (Q.Q5_1, 4e-2), (Q.Q4_0, 0.15),
                                       (Q.Q4_1, 0.08)])
def test_dequantize_round_trip(qtype, tol):
    values = np.random.default_rng(1).normal(size=(4, 256)).astype(np.float32)
    ours = dequantize_tensor(quantize(values, qtype), qtype, "t")
    scale = np.abs(values.reshape(4, -1, 32)).max(-1, keepdims=True).repeat(32, -1).reshape(4, 256)
    assert ours.shape == (4, 256)
    assert (np.abs(ours.numpy() - values) <= tol * scale + 1e-7).all()


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="type Q2_K, which tokenmill cannot load"):
        dequantize_tensor(rng.integers(0, 255, (2, 84), dtype=np.uint8), Q.Q2_K, "blk.0.x")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    w = GGUFWriter(str(tmp_path / "g.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    with pytest.raises(ValueError, match="architecture 'gemma' is not supported"):
        load_gguf(str(tmp_path / "g.gguf"), "auto", torch.device("cpu"), None)


def test_tensor_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="'blk.0.ssm_a' is not supported"):
        hf_name("blk.0.ssm_a")


def test_truncated_file_is_a_clear_error(tmp_path):
    model = tiny("llama", tie=True)
    write_gguf(tmp_path / "m.gguf", "llama", model.config, model.state_dict())
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-1000])  # inside the last tensor's data
    with pytest.raises(ValueError, match="cut.gguf.* (is not a valid GGUF file|is truncated)"):
        load_gguf(str(tmp_path / "cut.gguf"), "auto", torch.device("cpu"), None)


def test_auto_dtype_follows_the_weights(tmp_path):
    """A quantized file runs in bfloat16 where the CPU kernels are available (else float32);
    an all-F32 file stays float32."""
    from tokenmill.layers import ops

    model = tiny("llama", tie=False)
    write_gguf(tmp_path / "q.gguf", "llama", model.config, model.state_dict(), QUANT_MIX)
    write_gguf(tmp_path / "f.gguf", "llama", model.config, model.state_dict())
    quantized = LLM(str(tmp_path / "q.gguf"), max_model_len=64, max_num_seqs=1).engine.dtype
    assert quantized == (torch.bfloat16 if ops.available() else torch.float32)
    assert LLM(str(tmp_path / "f.gguf"), max_model_len=64, max_num_seqs=1).engine.dtype \
        == torch.float32


def test_reader_matches_the_gguf_package(tmp_path):
    """tokenmill's GGUF reader (loaders/gguf_file.py) against the `gguf` package's reader:
    every metadata value, every tensor's offset, shape and bytes."""
    from gguf import GGUFReader

    from tokenmill.loaders.gguf_file import read_gguf

    model = tiny("qwen2", tie=False)
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", model.config, model.state_dict(), QUANT_MIX)
    ours, theirs = read_gguf(str(path)), GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the package's own pseudo-fields
            value = field.contents()
            assert ours.fields[key] == (value.tolist() if hasattr(value, "tolist") else value)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.data_offset, a.n_bytes, a.tensor_type) == (b.data_offset, b.n_bytes,
                                                             b.tensor_type)
        assert a.data.shape == b.data.shape and np.array_equal(a.data, np.asarray(b.data))


@pytest.mark.parametrize("seed", range(40))
def test_corrupted_header_is_a_clear_error_or_loads(tmp_path, seed):
    """Random bytes overwritten in the header and metadata: the reader either reads a
    consistent file or raises a one-line ValueError; never another exception, a hang or a
    huge allocation."""
    from tokenmill.loaders.gguf_file import open_gguf

    model = tiny("llama", tie=True)
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", model.config, model.state_dict())
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(seed)
    header_end = 4096
    for at in rng.integers(4, header_end, size=int(rng.integers(1, 6))):
        data[at] = int(rng.integers(0, 256))
    bad = tmp_path / f"bad{seed}.gguf"
    bad.write_bytes(bytes(data))
    try:
        f = open_gguf(str(bad))
    except ValueError as e:
        assert "\n" not in str(e) and "bad" in str(e)
    else:
        assert all(t.data_offset + t.n_bytes <= len(data) for t in f.tensors)
