"""A random-weight Llama GGUF of a real model's size, for speed at sizes the package index has
no file of (its real files are 135M and 270M parameters, where fixed per-call costs weigh more
than at 1-7B). The vocabulary is llama.cpp's Llama-2 SentencePiece test vocabulary (32,000
tokens) from the shared fixtures, which TinyLlama-1.1B and Llama-2 use too, so the embedding
and LM head have the real models' shapes.

Speed only, like shape_model.py: the text is noise and nothing lossy may be judged on it.
Matrices are N(0, 0.02), norms ones; `--type` runs llama.cpp's `llama-quantize` on the BF16
file (build_llama_cpp.sh builds it).

    python benchmarks/sized_model.py tinyllama-1.1b [--type Q4_K_M]   # prints the file's path
    python benchmarks/compare_llamacpp.py --model "$(that path)" --file
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bf16_model import bench_dir  # noqa: E402

# name: (layers, hidden, ffn, heads, kv heads, context): the models' own config.json values
SIZES = {
    "tinyllama-1.1b": (22, 2048, 5632, 32, 4, 2048),
    "llama-2-7b": (32, 4096, 11008, 32, 32, 4096),
}
VOCAB = "tokenizers/gguf-vocab/ggml-vocab-llama-spm.gguf"


def _vocab() -> Path:
    for root in (os.environ.get("TOKENMILL_FIXTURES"),
                 Path(__file__).resolve().parents[2] / "shared" / "fixtures",
                 "/work/shared/fixtures"):
        if root and (Path(root) / VOCAB).exists():
            return Path(root) / VOCAB
    sys.exit(f"sized_model: {VOCAB} not found under the shared fixtures (set TOKENMILL_FIXTURES)")


def bf16_file(name: str, seed: int = 0) -> Path:
    import gguf

    dst = bench_dir() / f"{name}-random.BF16.gguf"
    if dst.exists():
        return dst
    layers, hidden, ffn, heads, kv_heads, ctx = SIZES[name]
    head_dim = hidden // heads
    vocab = gguf.GGUFReader(str(_vocab()))
    tmp = dst.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"{name} (random weights)")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for field in vocab.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)

    def matrix(tensor: str, rows: int, cols: int) -> None:
        data = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        bf16 = (data.view(np.uint32) >> 16).astype(np.uint16)  # truncated: any bf16 will do
        w.add_tensor(tensor, bf16.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)

    matrix("token_embd.weight", n_vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    matrix("output.weight", n_vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(b + "attn_q.weight", hidden, hidden)
        matrix(b + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(b + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(b + "attn_output.weight", hidden, hidden)
        matrix(b + "ffn_gate.weight", ffn, hidden)
        matrix(b + "ffn_up.weight", ffn, hidden)
        matrix(b + "ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


def quantized_file(name: str, qtype: str) -> Path:
    from benchmarks.quant_formats import quantized_file as quantize

    return quantize(qtype, bf16_file(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(SIZES))
    ap.add_argument("--type", default="BF16", help="BF16 or a llama-quantize type (Q4_K_M, ...)")
    args = ap.parse_args()
    print(quantized_file(args.name, args.type))


if __name__ == "__main__":
    main()
