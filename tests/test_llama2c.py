"""llama2.c checkpoints and tokenizer files: stories260K reproduces llama2.c's golden output."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch

from tests.gguf_util import llama_cpp_permute
from tokenmill import LLM, SamplingParams
from tokenmill.loaders.llama2c import is_llama2c_checkpoint, load_llama2c
from tokenmill.loaders.llama2c_tokenizer import load_llama2c_tokenizer


@pytest.fixture(scope="module")
def stories(fixtures):
    d = fixtures / "stories260K"
    return LLM(str(d / "stories260K.bin"), tokenizer=str(d / "tok512.bin"), dtype="float32")


def golden_text(fixtures) -> str:
    readme = (fixtures / "README.md").read_text(encoding="utf-8")
    block = re.search(r"decoded text exactly:\n\n```\n(.*?)```", readme, re.S).group(1)
    return block[:-1]  # the fence's own line break (run.c ends its output with a newline)


def test_golden_greedy_from_bos(stories, fixtures):
    # run.c forwards 200 positions (BOS at 0) and prints the token sampled at each: 200 tokens.
    out = stories.generate({"prompt_token_ids": [1]},
                           SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 200
    assert completion.text == golden_text(fixtures)


def test_tokenizer_matches_readme(stories):
    assert stories.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert stories.tokenizer.decode([1, 403, 407, 261, 378]) == "Once upon a time"


def test_tokenizer_matches_sentencepiece(fixtures):
    """The tok512.bin vocabulary rebuilt as BPE encodes like the original SentencePiece model.

    Texts avoid leading, trailing and repeated spaces: tok512.model collapses those
    (remove_extra_whitespaces), while llama2.c's run.c and llama.cpp keep every space."""
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(fixtures / "stories260K" / "tok512.model"))
    tok = load_llama2c_tokenizer(str(fixtures / "stories260K" / "tok512.bin"))
    texts = [golden_text(fixtures), "Hello world", "tabs\tand\nnewlines\n", "x" * 40, "",
             "Ünïcödé ∑ 🦙 日本語", "don't stop-believing!!", "Lily's mom said, \"No.\""]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text


def test_checkpoint_detection_and_errors(fixtures, tmp_path):
    path = fixtures / "stories260K" / "stories260K.bin"
    assert is_llama2c_checkpoint(str(path))
    assert not is_llama2c_checkpoint(str(fixtures / "stories260K" / "tok512.bin"))
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(path.read_bytes()[:50_000])
    with pytest.raises(ValueError, match="header implies"):
        load_llama2c(str(truncated), "auto", "cpu", None)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(struct.pack("<7i", -5, 1, 1, 1, 1, 1, 1) + b"\0" * 64)
    with pytest.raises(ValueError, match="not a llama2.c checkpoint"):
        load_llama2c(str(garbage), "auto", "cpu", None)


def test_bad_tokenizer_file(tmp_path):
    bad = tmp_path / "tok.bin"
    bad.write_bytes(struct.pack("<ifi", 4, 0.0, 99) + b"abc")  # a length past the end
    with pytest.raises(ValueError, match="not a llama2.c tokenizer"):
        load_llama2c_tokenizer(str(bad))


def test_tokenizer_found_next_to_checkpoint(fixtures):
    """llama2.c names a custom tokenizer tok{vocab}.bin: tok512.bin sits beside stories260K."""
    llm = LLM(str(fixtures / "stories260K" / "stories260K.bin"), max_num_seqs=1)
    assert llm.tokenizer is not None
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    text = out.outputs[0].text
    assert len(text) > 10 and golden_text(fixtures).startswith("Once upon a time" + text)


def write_llama2c(path, model) -> None:
    """A llama2.c legacy checkpoint with an unshared classifier (negative vocab size), written
    like llama2.c's export.py: Meta's interleaved Q/K rows, per-layer arrays stacked."""
    c, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    layers = range(c.num_hidden_layers)

    def stack(name, heads=None):
        arrays = [sd[f"model.layers.{i}.{name}.weight"] for i in layers]
        return np.stack([llama_cpp_permute(a, heads) if heads else a for a in arrays])

    head = c.hidden_size // c.num_attention_heads
    parts = [sd["model.embed_tokens.weight"], stack("input_layernorm"),
             stack("self_attn.q_proj", c.num_attention_heads),
             stack("self_attn.k_proj", c.num_key_value_heads), stack("self_attn.v_proj"),
             stack("self_attn.o_proj"), stack("post_attention_layernorm"),
             stack("mlp.gate_proj"), stack("mlp.down_proj"), stack("mlp.up_proj"),
             sd["model.norm.weight"], np.zeros((2, c.max_position_embeddings, head // 2)),
             sd["lm_head.weight"]]
    header = struct.pack("<7i", c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                         c.num_attention_heads, c.num_key_value_heads, -c.vocab_size,
                         c.max_position_embeddings)
    path.write_bytes(header + b"".join(p.astype("<f4").tobytes() for p in parts))


def test_unshared_classifier_checkpoint_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    write_llama2c(tmp_path / "m.bin", model)
    assert is_llama2c_checkpoint(str(tmp_path / "m.bin"))
    ids = [1, 5, 60, 7, 33, 2, 90]
    ours = LLM(str(tmp_path / "m.bin"), max_num_seqs=1).engine.compute_logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
