"""`tokenmill tokenize` (commands/tokenize.py) on the fixture tokenizers: ids checked against the
`tokenizers` library and llama2.c's published ids, each token shown as text or as the bytes of
part of a character, stdin, and --compare's tokens per character on the built-in texts."""

from __future__ import annotations

import ast
import io
import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.cli import main
from tokenmill.parallel_texts import SAMPLES, TRANSLATIONS

TEXT = "Hello world! 你好，世界。こんにちは"


@pytest.fixture(scope="module")
def gpt2_dir(fixtures) -> str:
    return str(fixtures / "tokenizers" / "gpt2")


@pytest.fixture(scope="module")
def gpt2(gpt2_dir) -> BackendTokenizer:
    return BackendTokenizer.from_file(f"{gpt2_dir}/tokenizer.json")


def tokenize(capsys, *args: str) -> str:
    assert main(["tokenize", *args]) == 0
    return capsys.readouterr().out


def table(out: str) -> tuple[list[int], list[str | bytes]]:
    """(ids, values) of the token table: lines '  position  id  repr', then a summary."""
    rows = [line.split(maxsplit=2) for line in out.splitlines()[1:-1]]
    assert [int(r[0]) for r in rows] == list(range(len(rows)))
    return [int(r[1]) for r in rows], [ast.literal_eval(r[2]) for r in rows]


def test_ids_are_the_tokenizers_and_tokens_spell_the_text(capsys, gpt2_dir, gpt2):
    out = tokenize(capsys, gpt2_dir, TEXT)
    ids, values = table(out)
    assert ids == gpt2.encode(TEXT).ids
    assert values[:3] == ["Hello", " world", "!"]
    assert any(isinstance(v, bytes) for v in values)  # CJK characters cut into byte pieces
    assert b"".join(v if isinstance(v, bytes) else v.encode() for v in values) == TEXT.encode()
    assert out.splitlines()[-1] == (f"{len(ids)} tokens, {len(TEXT)} characters "
                                    f"({len(ids) / len(TEXT):.2f} tokens per character)")


def test_json_and_a_tokenizer_json_path(capsys, gpt2_dir, gpt2):
    out = json.loads(tokenize(capsys, f"{gpt2_dir}/tokenizer.json", "你好", "--json"))
    ids = gpt2.encode("你好").ids
    assert [t["id"] for t in out["tokens"]] == ids and out["count"] == len(ids)
    assert bytes(sum((t["bytes"] for t in out["tokens"]), [])) == "你好".encode()


def test_stdin_and_the_default_model(capsys, monkeypatch, gpt2_dir, gpt2):
    monkeypatch.setattr("tokenmill.commands.tokenize.DEFAULT_MODEL", gpt2_dir)
    for args in [(gpt2_dir, "-"), (gpt2_dir,), ("-",), ()]:
        monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
        assert table(tokenize(capsys, *args))[0] == gpt2.encode("from stdin\n").ids, args
    assert table(tokenize(capsys, "just text"))[0] == gpt2.encode("just text").ids


def test_llama2c_checkpoint_adds_bos(capsys, fixtures):
    model = str(fixtures / "stories260K" / "stories260K.bin")
    ids, values = table(tokenize(capsys, model, "Once upon a time"))
    assert ids == [1, 403, 407, 261, 378]  # the fixture's README, from llama2.c
    assert values == ["<s>", " Once", " upon", " a", " time"]
    ids, _ = table(tokenize(capsys, model, "Once upon a time", "--no-special-tokens"))
    assert ids == [403, 407, 261, 378]


def test_compare_counts_tokens_per_character(capsys, gpt2_dir, gpt2):
    out = json.loads(tokenize(capsys, gpt2_dir, "--compare", "--json"))
    assert out["vocab_size"] == 50257
    rows = {r["text"]: r for r in out["rows"]}
    assert list(rows) == list(SAMPLES)
    english = len(gpt2.encode(TRANSLATIONS["English"]).ids)
    for name, text in SAMPLES.items():
        n = len(gpt2.encode(text).ids)
        assert (rows[name]["characters"], rows[name]["tokens"]) == (len(text), n), name
        assert rows[name]["tokens_per_character"] == pytest.approx(n / len(text))
        expected = n / english if name in TRANSLATIONS else None
        assert rows[name]["relative_to_english"] == pytest.approx(expected), name
    # GPT-2 spends under 0.3 tokens on an English character and 1.4 or more on a Chinese or
    # Japanese one: over 5x the tokens per character, and more tokens for the same sentences
    assert rows["English"]["tokens_per_character"] < 0.3
    for name in ["Chinese", "Japanese"]:
        assert rows[name]["tokens_per_character"] >= 1.4, name
        assert rows[name]["tokens"] > 2 * rows["English"]["tokens"], name


def test_compare_table(capsys, gpt2_dir, gpt2):
    lines = tokenize(capsys, gpt2_dir, "--compare").splitlines()
    assert lines[0] == f"{gpt2_dir}: 50257 tokens in the vocabulary"
    chinese = next(line.split() for line in lines if line.startswith("Chinese"))
    n, chars = len(gpt2.encode(TRANSLATIONS["Chinese"]).ids), len(TRANSLATIONS["Chinese"])
    english = len(gpt2.encode(TRANSLATIONS["English"]).ids)
    assert chinese == ["Chinese", str(chars), str(n), f"{n / chars:.2f}", f"{n / english:.2f}x"]
    assert lines[-1].split()[-1] == "-"  # code is no translation of the English


@pytest.mark.parametrize("args", [("a", "b", "c"), ("m", "text", "--compare")])
def test_too_many_arguments(capsys, args):
    assert main(["tokenize", *args]) == 2
    assert "tokenmill tokenize: error: expected [MODEL]" in capsys.readouterr().err


def test_options_between_the_model_and_the_text(capsys, gpt2_dir):
    """argparse stops a positional list at the first option: the text after it still counts,
    in order (as in `tokenmill generate MODEL --raw PROMPT`)."""
    assert tokenize(capsys, gpt2_dir, "--json", TEXT) == tokenize(capsys, "--json", gpt2_dir, TEXT)
    with pytest.raises(SystemExit):  # argparse's usage error, as before
        main(["tokenize", gpt2_dir, "--json", TEXT, "--no-such-option"])
    assert "unrecognized arguments: " in capsys.readouterr().err
