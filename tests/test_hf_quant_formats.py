"""Pre-quantized Hugging Face checkpoints (quantization/hf_formats.py): AWQ, GPTQ (with and
without act order, v1 and v2 zeros, 4 and 8 bits) and compressed-tensors, each packed here
from known codes following the formats' published definitions, read back exactly (the zero
point's product within float16 rounding), and a whole model in each layout against the same
weights in float."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_gguf_loader import IDS, tiny
from tokenmill import LLM
from tokenmill.quantization.hf_formats import AWQ_ORDER, checkpoint_format, read

transformers = pytest.importorskip("transformers")


def pack(vals: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Codes -> int32 words, 32 / bits per word along dim (0 rows, 1 columns); value i of a
    word at bits i * bits, holding element order[i] of its run (sequential without order)."""
    per = 32 // bits
    v = vals.to(torch.int64)
    if dim == 0:
        v = v.T
    v = v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[:, :, order]
    word = sum(v[:, :, i] << (i * bits) for i in range(per))
    word = torch.from_numpy((word.numpy() & 0xFFFFFFFF).astype(np.uint32).view(np.int32))
    return word.T.contiguous() if dim == 0 else word


def quantize_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int):
    """Asymmetric per (output, group) codes of w (out, in): q (in, out), s, z (groups, out)."""
    top = (1 << bits) - 1
    s = torch.zeros(groups, w.shape[0])
    z = torch.zeros(groups, w.shape[0], dtype=torch.int64)
    for gi in range(groups):
        cols = w[:, g_idx == gi]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        s[gi] = ((hi - lo) / top).half().float()
        z[gi] = torch.round(-lo / s[gi]).clamp(0, top).long()
    q = torch.round(w / s[g_idx].T + z[g_idx].T).clamp(0, top).long().T  # (in, out)
    return q, s.half(), z


def expected(q, s, z, g_idx) -> torch.Tensor:
    return (s.float()[g_idx] * (q - z[g_idx]).float()).T  # (out, in)


def layouts(name: str, w: torch.Tensor, rng: torch.Generator):
    """(quantization_config, tensors for this linear, the weight they encode)."""
    out, k = w.shape
    group = 64
    g_idx = torch.arange(k) // group
    if name.startswith("gptq-act"):  # act order: inputs assigned to groups out of order
        g_idx = g_idx[torch.randperm(k, generator=rng)]
    bits = 8 if name.endswith("8") else 4
    q, s, z = quantize_groups(w, g_idx, k // group, bits)
    ref = expected(q, s, z, g_idx)
    if name == "awq":
        cfg = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
               "zero_point": True}
        return cfg, {"qweight": pack(q, 4, 1, AWQ_ORDER), "qzeros": pack(z, 4, 1, AWQ_ORDER),
                     "scales": s}, ref
    if name.startswith("gptq"):
        v2 = name.startswith("gptq-v2")
        cfg = {"quant_method": "gptq", "bits": bits, "group_size": group,
               "desc_act": name.startswith("gptq-act"),
               "checkpoint_format": "gptq_v2" if v2 else "gptq"}
        return cfg, {"qweight": pack(q, bits, 0), "qzeros": pack(z - (0 if v2 else 1), bits, 1),
                     "scales": s, "g_idx": g_idx.to(torch.int32)}, ref
    # compressed-tensors: symmetric, stored as q + 2**(bits - 1)
    half = 1 << (bits - 1)
    sym = (w.abs().reshape(out, k // group, group).amax(-1) / (half - 1)).half()
    qs = torch.round(w / sym.float().repeat_interleave(group, 1)).clamp(-half, half - 1)
    ref = qs * sym.float().repeat_interleave(group, 1)
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group}}}, "ignore": ["lm_head"]}
    return cfg, {"weight_packed": pack((qs + half).long(), bits, 1), "weight_scale": sym,
                 "weight_shape": torch.tensor([out, k])}, ref


NAMES = ["awq", "gptq", "gptq-v2", "gptq8", "gptq-act", "gptq-act8", "ct", "ct8"]


@pytest.mark.parametrize("name", NAMES)
def test_layout_reads_back(name):
    rng = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=rng)
    cfg, parts, ref = layouts(name, w, rng)
    out = list(read(checkpoint_format({"quantization_config": cfg}),
                    iter([(f"layer.{p}", t) for p, t in parts.items()])))
    assert len(out) == 1 and out[0][0] == "layer.weight"
    got = out[0][1].dequantize()
    zero_term = (ref.abs().max() * 2 ** -10).item()  # float16 rounding of -s * z
    assert (got - ref).abs().max().item() <= zero_term


@pytest.mark.parametrize("name", ["awq", "gptq-act", "ct"])
def test_model_in_each_layout(tmp_path, name):
    model = tiny("llama", tie=False)
    model.save_pretrained(tmp_path / "ref")
    state = load_file(tmp_path / "ref" / "model.safetensors")
    rng = torch.Generator().manual_seed(1)
    quantized, cfg = {}, None
    for key, t in state.items():
        if t.dim() == 2 and "proj" in key:
            cfg, parts, ref = layouts(name, t.float(), rng)
            prefix = key.removesuffix(".weight")
            quantized.update({f"{prefix}.{p}": v for p, v in parts.items()})
            state[key] = ref
        else:
            quantized[key] = t
    (tmp_path / "q").mkdir()
    save_file({k: v.contiguous() for k, v in quantized.items()},
              tmp_path / "q" / "model.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()},
              tmp_path / "ref" / "model.safetensors")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    config["quantization_config"] = cfg
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    ours = LLM(str(tmp_path / "q"), max_model_len=64, max_num_seqs=1).engine.compute_logits(IDS)
    ref = LLM(str(tmp_path / "ref"), dtype="float32", max_model_len=64,
              max_num_seqs=1).engine.compute_logits(IDS)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.08  # int8 activations, bf16


@pytest.mark.parametrize("cfg,match", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ gemv"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "float-quantized"),
])
def test_unsupported_variants_name_what_they_found(cfg, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_format({"quantization_config": cfg})


def test_mismatched_scales_are_refused():
    rng = torch.Generator().manual_seed(0)
    cfg, parts, _ = layouts("gptq", torch.randn(48, 256, generator=rng), rng)
    parts["scales"] = parts["scales"][:, :16]
    with pytest.raises(ValueError, match="do not match"):
        list(read(checkpoint_format({"quantization_config": cfg}),
                  iter([(f"layer.{p}", t) for p, t in parts.items()])))
    with pytest.raises(ValueError, match="but not"):
        list(read(checkpoint_format({"quantization_config": cfg}),
                  iter([("layer.qweight", parts["qweight"])])))
