"""Tokenizers built from GGUF metadata reproduce llama.cpp's own tokenizer test vectors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenmill.loaders.gguf_file import open_gguf
from tokenmill.loaders.gguf_tokenizer import load_gguf_tokenizer, read_gguf_vocab
from tokenmill.loaders.vocab import build_tokenizer

VOCABS = ["ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"]
SEPARATOR = "\n__ggml_vocab_test__\n"


def vectors(folder, name) -> list[tuple[str, list[int]]]:
    """llama.cpp's format: each test string followed by the separator line; .out has one line
    of ids per string, encoded without BOS (HF add_special_tokens=False, which generated them)."""
    texts = (folder / f"{name}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    assert texts[-1] == ""
    lines = (folder / f"{name}.out").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines) == 46
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@pytest.fixture(scope="module")
def vocab_dir(fixtures):
    return fixtures / "tokenizers" / "gguf-vocab"


@pytest.fixture(scope="module")
def vocabs(vocab_dir):
    """name -> Vocab, read once: parsing GGUF metadata takes seconds."""
    return {name: read_gguf_vocab(open_gguf(str(vocab_dir / name))) for name in VOCABS}


@pytest.fixture(scope="module")
def tokenizers(vocabs):
    return {name: build_tokenizer(vocab) for name, vocab in vocabs.items()}


@pytest.fixture(params=VOCABS)
def case(request, vocab_dir, tokenizers):
    return tokenizers[request.param], vectors(vocab_dir, request.param)


def test_every_vector_line(case):
    tok, cases = case
    failures = [(text, want, tok.encode(text, add_special_tokens=False)) for text, want in cases
                if tok.encode(text, add_special_tokens=False) != want]
    assert not failures, f"{len(failures)}/{len(cases)} lines differ, first: {failures[0]}"


def test_decode_round_trips(case):
    tok, cases = case
    for text, ids in cases:
        assert tok.decode(ids) == text


def test_load_gguf_tokenizer(vocab_dir):
    tok = load_gguf_tokenizer(str(vocab_dir / "ggml-vocab-llama-spm.gguf"))
    assert tok.encode("Hello world") == [1, 15043, 3186]


def test_special_tokens_and_bos(tokenizers):
    spm = tokenizers["ggml-vocab-llama-spm.gguf"]
    assert spm.add_bos_token and spm.bos_token_id == 1 and spm.eos_token_ids == [2]
    assert spm.encode("Hello world") == [1, 15043, 3186]
    assert spm.decode([1, 15043, 3186, 2]) == "Hello world"
    assert spm.decode([1, 15043, 2], skip_special_tokens=False) == "<s> Hello</s>"
    gpt2 = tokenizers["ggml-vocab-gpt-2.gguf"]
    assert not gpt2.add_bos_token and gpt2.eos_token_ids == [50256]
    ids = gpt2.encode("Hello<|endoftext|>")  # control tokens are matched whole
    assert ids == [15496, 50256] and gpt2.decode(ids) == "Hello"


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_split_regexes_match_transformers(vocab_dir, vocabs, pre):
    """The pre-tokenizer chosen by tokenizer.ggml.pre splits text like transformers' GGUF
    tokenizer for the same name (the vocabulary is GPT-2's; only the split is compared)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    vocab = dataclasses.replace(vocabs["ggml-vocab-gpt-2.gguf"], pre=pre)
    ours = build_tokenizer(vocab).backend.pre_tokenizer
    theirs, _ = mapping.convert_gguf_tokenizer("gpt2", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": vocab.tokens,
        "merges": [" ".join(m) for m in vocab.merges], "token_type": vocab.types})
    for text, _ in vectors(vocab_dir, "ggml-vocab-gpt-2.gguf"):
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenizer.pre_tokenize_str(text), text


def test_unknown_pre_tokenizer_is_a_clear_error(vocabs):
    vocab = dataclasses.replace(vocabs["ggml-vocab-gpt-2.gguf"], pre="made-up")
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up' is not supported"):
        build_tokenizer(vocab)


def test_inconsistent_metadata_is_a_clear_error(vocabs):
    spm = vocabs["ggml-vocab-llama-spm.gguf"]
    vocab = dataclasses.replace(spm, scores=spm.scores[:-1])
    with pytest.raises(ValueError, match="32000 tokens but 31999 token scores"):
        build_tokenizer(vocab)


def test_merges_are_cached_by_vocabulary(vocabs, tmp_path, monkeypatch):
    """A SentencePiece vocabulary's merges (recovered from its scores) are stored the first
    time and read back after: the same merges, no recomputation. A damaged or mismatched file
    is recomputed; other scores are another file."""
    from tokenmill.loaders import vocab as vocab_module
    from tokenmill.loaders.merges_cache import cache_path, cached_merges
    from tokenmill.loaders.vocab import _token_ids, merges_from_scores

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    vocab = vocabs["ggml-vocab-llama-spm.gguf"]
    ids, want = _token_ids(vocab.tokens), merges_from_scores(vocab)
    path = cache_path(vocab.tokens, vocab.types, vocab.scores)
    assert not path.exists()
    assert cached_merges(vocab, merges_from_scores, ids) == want and path.exists()

    def fail(*_):
        raise AssertionError("recomputed")

    assert cached_merges(vocab, fail, ids) == want
    monkeypatch.setattr(vocab_module, "merges_from_scores", fail)  # the tokenizer reads it too
    text = "Hello world, it's 3.14 ▁ héllo"
    assert build_tokenizer(vocab).encode(text) == build_tokenizer(
        dataclasses.replace(vocab, merges=want)).encode(text)
    for damage in (b"junk", path.read_bytes()[:100]):
        path.write_bytes(damage)
        assert cached_merges(vocab, merges_from_scores, ids) == want
    np.save(path, np.array([[0, len(vocab.tokens)]], dtype=np.int32))  # an id past the vocabulary
    assert cached_merges(vocab, merges_from_scores, ids) == want
    assert np.load(path).shape == (len(want), 2)
    other = dataclasses.replace(vocab, scores=[s + 1.0 if i == 500 else s
                                               for i, s in enumerate(vocab.scores)])
    assert cache_path(other.tokens, other.types, other.scores) != path


@pytest.mark.parametrize("name", VOCABS)
def test_string_arrays_read_as_the_gguf_package_reads_them(vocab_dir, name):
    """gguf_file's string-array loop (the vocabulary, the merges) against the gguf package's
    reader, element for element."""
    from gguf import GGUFReader

    from tokenmill.loaders.gguf_file import read_gguf

    ours = read_gguf(str(vocab_dir / name)).fields
    theirs = GGUFReader(str(vocab_dir / name)).fields
    keys = [k for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if k in theirs]
    assert keys
    for key in keys:
        field = theirs[key]
        expected = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        assert ours[key] == expected, key


def test_a_file_cut_inside_a_string_array_is_a_clear_error(vocab_dir, tmp_path):
    from tokenmill.loaders.gguf_file import read_gguf

    data = (vocab_dir / VOCABS[0]).read_bytes()
    # 16 cuts in a row inside the vocabulary (its tokens take a few bytes each after their
    # 8-byte lengths): some fall inside a string, some inside a length
    for cut in range(len(data) // 4, len(data) // 4 + 16):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="runs past the end of the file"):
            read_gguf(str(tmp_path / "cut.gguf"))
