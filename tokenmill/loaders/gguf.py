"""GGUF model files (llama.cpp's format), for the architectures models/registry.py lists.

Hyperparameters come from the `{arch}.*` metadata; tensors are renamed to Hugging Face names
(the family's own names and metadata keys: its GGUFFamily, loaders/gguf_family.py).
With dtype="auto", where the CPU kernels run quantized weights fast (ops.quantized_kernels),
the weight matrices stay quantized (quantization/gguf_blocks.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K; float tensors, other types, and any fused projection with one of them, are
dequantized) and the activations run in bfloat16. Otherwise every tensor is dequantized at
load to the engine dtype: dtype="auto" then means bfloat16 for quantized/16-bit files (on CPU
when tokenmill's kernels are available, else float32; see loaders.resolve_dtype) and float32
for F32 files; dtype="float32" keeps the dequantized values exact, which the tests use to
match llama.cpp/transformers closely.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from tokenmill.loaders import build_model, resolve_dtype
from tokenmill.loaders.gguf_family import LAYER_NAMES, GGUFFamily, GGUFMeta
from tokenmill.loaders.gguf_file import GGUFFile, field_value, open_gguf
from tokenmill.loaders.permute import unpermute_rope_rows
from tokenmill.models.config import ModelConfig
from tokenmill.models.registry import gguf_family
from tokenmill.quantization import QuantWeight
from tokenmill.quantization.gguf_blocks import NATIVE_TYPES, GGUFMatrix

_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                   _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, family: GGUFFamily | None = None) -> str:
    """'blk.0.attn_q.weight' -> 'model.layers.0.self_attn.q_proj.weight'."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = family.layer_names if family else LAYER_NAMES
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported by tokenmill")


def gguf_family_of(reader: GGUFFile) -> GGUFFamily:
    return gguf_family(field_value(reader, "general.architecture"))


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """ModelConfig from the `{arch}.*` metadata keys every family shares, then the family's
    own (its GGUFFamily.config)."""
    arch = field_value(reader, "general.architecture")
    family = gguf_family(arch)
    meta = GGUFMeta(reader, arch)
    if meta.raw("expert_count", 0):
        raise ValueError("mixture-of-experts GGUF files are not supported")

    heads, hidden = meta.get("attention.head_count"), meta.get("embedding_length")
    head_dim = meta.get("attention.key_length", hidden // heads)
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # token_embd's shape is (hidden, vocab) in GGUF's fastest-dimension-first order
    vocab = meta.raw("vocab_size") or (
        int(embed.shape[-1]) if embed is not None else len(tokens or ()))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=family.architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.get("feed_forward_length"),
        num_hidden_layers=meta.get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=meta.get("context_length", 2048),
        rms_norm_eps=meta.get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.get("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(meta),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        torch_dtype=_weights_dtype(reader),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[eos] if eos is not None else [],
    )
    fields.update(family.config(meta, fields))
    # partial rotary embeddings only where the family's config says so (rotary_dim)
    if meta.get("rope.dimension_count", head_dim) != (fields.get("rotary_dim") or head_dim):
        raise ValueError(f"GGUF {arch} models with partial rotary embeddings are not supported")
    return ModelConfig(**fields)


def _weights_dtype(reader: GGUFFile) -> str:
    """'float32' for an all-F32 file; otherwise the weights had 16 bits or fewer to begin with,
    and 'auto' runs them in bfloat16."""
    matrices = [t for t in reader.tensors if len(t.shape) > 1]
    f32 = all(t.tensor_type == GGMLQuantizationType.F32 for t in matrices)
    return "float32" if f32 else "bfloat16"


def _rope_scaling(meta: GGUFMeta) -> dict | None:
    kind = meta.raw("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.get("rope.scaling.factor")}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (only none, linear)")


def dequantize_tensor(data: np.ndarray, qtype: int, name: str, copy: bool = True) -> torch.Tensor:
    """GGUF tensor bytes -> float32 tensor in PyTorch's (rows, cols) order; an F32 tensor with
    copy=False is a read-only view of the mapped file."""
    if qtype not in SUPPORTED_TYPES:
        try:
            qname = _Q(qtype).name
        except ValueError:
            qname = str(qtype)
        raise ValueError(f"GGUF tensor {name!r} has type {qname}, which tokenmill cannot load; "
                         f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    # a plain ndarray view: slicing np.memmap objects row by row is several times slower
    values = np.ascontiguousarray(dequantize(np.asarray(data), qtype), dtype=np.float32)
    if not values.flags.writeable and copy:  # float32 tensors come back as views of the file
        values = values.copy()
    return _tensor(values)


def bf16_matrix(data: np.ndarray) -> torch.Tensor:
    """A BF16 GGUF matrix's bits as a bfloat16 tensor, for a bfloat16 model: a read-only view of
    the mapped file (no float32 copy on the way: Gemma-3-270M's 335 MB embedding made a 2.4 GB
    start-up peak that way)."""
    return _tensor(np.asarray(data).view(np.int16)).view(torch.bfloat16)


def _tensor(values: np.ndarray) -> torch.Tensor:
    """torch.from_numpy, also of a read-only view of the file (which is only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


def gguf_weights(reader: GGUFFile, cfg: ModelConfig, keep_quantized: bool = False,
                 dtype: torch.dtype = torch.float32,
                 ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(Hugging Face name, float32 tensor), or GGUFMatrix for weight matrices of a native type
    with keep_quantized; BF16 matrices stay bfloat16 for a bfloat16 `dtype` (the same values
    either way). BF16 and F32 tensors and GGUFMatrix blocks are read-only views of the mapped
    file, which the consumer copies or packs as it takes them (others are fresh float32); the
    file pages read so far are let go before each tensor is yielded, so the mapped file never
    becomes resident all at once."""
    family = gguf_family_of(reader)
    permute = family.permute_qk
    for t in reader.tensors:
        if t.name in family.consumed:
            continue
        name = hf_name(t.name, family)
        if keep_quantized and len(t.shape) == 2 and t.tensor_type in NATIVE_TYPES:
            tensor = GGUFMatrix.from_file(t.data, t.tensor_type, int(t.shape[0]), t.data_offset)
        elif dtype == torch.bfloat16 and len(t.shape) == 2 and t.tensor_type == _Q.BF16:
            tensor = bf16_matrix(t.data)
        else:
            tensor = dequantize_tensor(t.data, t.tensor_type, t.name, copy=False)
        if family.to_hf is not None and not isinstance(tensor, QuantWeight):
            tensor = family.to_hf(name, tensor)
        if permute and ".q_proj." in name:
            tensor = _unpermute(tensor, cfg.num_attention_heads)
        elif permute and ".k_proj." in name:
            tensor = _unpermute(tensor, cfg.num_key_value_heads)
        reader.drop_pages()  # before the consumer copies it (a view would read the file again)
        yield name, tensor


def _unpermute(tensor, heads: int):
    if isinstance(tensor, QuantWeight):
        return tensor.map_rows(lambda t: unpermute_rope_rows(t, heads))
    return unpermute_rope_rows(tensor, heads)


def load_gguf(path: str, dtype: str, device: torch.device,
              max_positions: int | None) -> tuple[nn.Module, ModelConfig, torch.dtype]:
    from tokenmill.layers import ops

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    keep = (dtype == "auto" and device.type == "cpu" and ops.current().quantized_kernels
            and cfg.torch_dtype != "float32")
    torch_dtype = torch.bfloat16 if keep else resolve_dtype(dtype, cfg.torch_dtype, device)
    model = build_model(cfg, torch_dtype, device, max_positions or cfg.max_position_embeddings)
    with _packed_cache(path, keep):
        model.load_weights(gguf_weights(reader, cfg, keep, torch_dtype))
    return model, cfg, torch_dtype


def _packed_cache(path: str, keep: bool):
    """The kernels' cache of this file's packed matrices (kernels/packed_cache.py), where they
    stay quantized."""
    from tokenmill.distributed import group as tp
    from tokenmill.kernels import packed_cache
    from tokenmill.layers import ops

    lib = getattr(ops.current(), "lib", None)
    if not keep or lib is None:
        return contextlib.nullcontext()
    group = tp.current()
    return packed_cache.loading(path, lib, (group.rank, group.size) if group else (0, 1))
