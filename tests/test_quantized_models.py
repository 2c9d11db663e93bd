"""Models whose weights stay quantized: GGUF files run from their blocks (dtype="auto"), and
float checkpoints quantized at load (quantization="int8" / "int4"). The oracle is the same model
with the same quantized weights dequantized to float32 (which matches transformers: see
test_gguf_loader.py); the only difference allowed is the kernels' int8 activations."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.gguf_util import write_gguf
from tests.test_gguf_loader import IDS, tiny
from tokenmill import LLM
from tokenmill.layers import ops
from tokenmill.layers.linear import Linear, quant_of

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (ops.available() and ops.select(True, torch.device("cpu")).quantized_kernels),
    reason="the kernels here have no fast quantized path (quantized files are dequantized)")

# every native type (q|k|v mixes 4-, 5- and 8-bit codes), and a fused projection with a float
# part (up: F16), which makes gate|up dequantized
NATIVE_MIX = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q5_1, "attn_q.weight": Q.Q4_K,
              "attn_k.weight": Q.Q5_K, "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q4_0,
              "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.F16, "ffn_down.weight": Q.Q5_0}
# relative error of the logits (Frobenius norms): bf16 activations quantized to int8 per 32
# against float32 ones; measured 0.9-3.3 % on these random tiny models (a wrong weight, scale
# or row order gives ~100 %)
TOLERANCE = 0.08


def logits(llm: LLM) -> torch.Tensor:
    return llm.engine.compute_logits(IDS)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = ((a - b).norm() / b.norm()).item()
    print(f"relative logit error {err:.4f}")
    assert err < TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_runs_from_its_blocks(tmp_path, arch):
    model = tiny(arch, tie=False)
    write_gguf(tmp_path / "m.gguf", arch, model.config, model.state_dict(), NATIVE_MIX)
    native = LLM(str(tmp_path / "m.gguf"), max_model_len=64, max_num_seqs=1)
    exact = LLM(str(tmp_path / "m.gguf"), dtype="float32", max_model_len=64, max_num_seqs=1)
    m = native.engine.runner.model
    layer = m.model.layers[0]
    assert native.engine.dtype == torch.bfloat16
    for module, quantized in ((m.model.embed_tokens, True), (m.lm_head, True),
                              (layer.self_attn.o_proj, True), (layer.mlp.down_proj, True),
                              (layer.self_attn.qkv_proj, True), (layer.mlp.gate_up_proj, False)):
        assert (quant_of(module.weight) is not None) == quantized
    close(logits(native), logits(exact))


def test_tied_quantized_embedding_is_shared(tmp_path):
    model = tiny("llama", tie=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_gguf(tmp_path / "m.gguf", "llama", model.config, state,
               {"token_embd.weight": Q.Q8_0, "attn_": Q.Q4_1, "ffn_": Q.Q4_0})
    native = LLM(str(tmp_path / "m.gguf"), max_model_len=64, max_num_seqs=1)
    m = native.engine.runner.model
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert quant_of(m.lm_head.weight) is not None
    assert m.lm_head.weight.untyped_storage().nbytes() <= 4  # no float copy
    exact = LLM(str(tmp_path / "m.gguf"), dtype="float32", max_model_len=64, max_num_seqs=1)
    close(logits(native), logits(exact))


@pytest.mark.parametrize("method", ["int8", "int4", "int4-g128"])
def test_float_checkpoint_quantized_at_load(tmp_path, method):
    from tokenmill.quantization.rtn import quantize

    model = tiny("qwen2", tie=False)
    model.save_pretrained(tmp_path / "hf")
    q = LLM(str(tmp_path / "hf"), quantization=method, max_model_len=64, max_num_seqs=1)
    linears = [mod for mod in q.engine.runner.model.modules() if isinstance(mod, Linear)]
    assert linears and all(quant_of(mod.weight) is not None for mod in linears)
    # the oracle: the float model with each linear weight replaced by its dequantized form
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(quantize(p, method).dequantize())
    model.save_pretrained(tmp_path / "ref")
    ref = LLM(str(tmp_path / "ref"), dtype="float32", max_model_len=64, max_num_seqs=1)
    close(logits(q), logits(ref))


def test_unknown_quantization_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        LLM("unused", quantization="int3")
