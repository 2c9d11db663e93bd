"""benchmarks/sized_model.py: a random-weight Llama GGUF of given shapes with the fixtures'
Llama-2 vocabulary: every tensor of the family at its shape in BF16, the vocabulary's tokenizer
(its own test vectors), and the file runs; and the benchmarks' file stems keep dotted names."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from benchmarks import sized_model
from benchmarks.bf16_model import model_stem
from tests.test_gguf_tokenizer import vectors
from tokenmill import LLM, SamplingParams

TINY = (2, 64, 96, 4, 2, 128)  # layers, hidden, ffn, heads, kv heads, context


@pytest.fixture
def tiny_file(tmp_path, monkeypatch, fixtures):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOKENMILL_FIXTURES", str(fixtures))
    monkeypatch.setitem(sized_model.SIZES, "tiny", TINY)
    return sized_model.bf16_file("tiny")


def test_every_tensor_at_its_shape(tiny_file):
    layers, hidden, ffn, heads, kv_heads, _ = TINY
    kv = kv_heads * hidden // heads
    want = {"token_embd.weight": (32000, hidden), "output.weight": (32000, hidden),
            "output_norm.weight": (hidden,)}
    for i in range(layers):
        want |= {f"blk.{i}.{n}.weight": s for n, s in [
            ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]}
    reader = gguf.GGUFReader(str(tiny_file))
    got = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert got == want
    assert all(t.tensor_type == gguf.GGMLQuantizationType.BF16
               for t in reader.tensors if len(t.shape) > 1)
    assert reader.fields["llama.attention.head_count_kv"].contents() == kv_heads
    assert sized_model.bf16_file("tiny") == tiny_file  # cached: written once


def test_the_vocabulary_tokenizes_as_llama_cpp_and_the_file_runs(tiny_file, fixtures):
    llm = LLM(str(tiny_file), max_model_len=64, max_num_seqs=1)
    tok = llm.get_tokenizer()
    vocab = fixtures / sized_model.VOCAB
    for text, ids in vectors(vocab.parent, vocab.name):  # llama.cpp's vectors for this vocab
        assert tok.encode(text, add_special_tokens=False) == ids, text
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_stems_keep_dotted_names():
    assert model_stem(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert model_stem(Path("tinyllama-1.1b-random.BF16.gguf")) == "tinyllama-1.1b-random"
    assert model_stem(Path("gemma-3-270m-q4_k_m.gguf")) == "gemma-3-270m-q4_k_m"
