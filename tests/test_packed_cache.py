"""The packed-weights cache (kernels/packed_cache.py): a second load of a GGUF file maps the
packed matrices the first load wrote, and computes the same logits, bit for bit, as a load
without the cache; a changed file, a corrupt cache or an unwritable folder fall back to packing."""

from __future__ import annotations

import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.gguf_util import write_gguf
from tests.test_gguf_loader import IDS, tiny
from tests.test_quantized_models import pytestmark  # noqa: F401  (the same skip)
from tokenmill import LLM
from tokenmill.kernels import packed_cache

MIX = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K, "attn_q.weight": Q.Q4_K,
       "attn_k.weight": Q.Q5_K, "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q4_0,
       "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.Q5_0, "ffn_down.weight": Q.Q8_0}


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Every file counts as large, and the caches opened are recorded."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(packed_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(packed_cache, "_large_folios", lambda: True)
    opened = []
    original = packed_cache.PackedCache.open.__func__

    def record(cls, *args):
        opened.append(original(cls, *args))
        return opened[-1]

    monkeypatch.setattr(packed_cache.PackedCache, "open", classmethod(record))
    return opened


def model_file(path, seed=0):
    model = tiny("llama", tie=False)
    write_gguf(path, "llama", model.config, model.state_dict(), MIX, seed=seed)
    return str(path)


def logits(path) -> torch.Tensor:
    return LLM(path, max_model_len=64, max_num_seqs=1).engine.compute_logits(IDS)


def test_second_load_maps_what_the_first_packed(tmp_path, caches, monkeypatch):
    path = model_file(tmp_path / "m.gguf")
    abandoned = packed_cache.folder() / "0123.bin.999999999.tmp"  # a process that died mid-load
    abandoned.parent.mkdir(parents=True)
    abandoned.write_bytes(b"partial")
    first = logits(path)
    assert not abandoned.exists()
    assert not caches[0].hit and not caches[0].broken and len(caches[0].entries) >= 5
    files = sorted(p.suffix for p in packed_cache.folder().iterdir())
    assert files == [".bin", ".json"]  # no temporary file left
    second = logits(path)
    assert caches[1].hit and not caches[1].broken
    assert caches[1]._next == len(caches[1].entries)  # every packed matrix from the file
    monkeypatch.setenv("TOKENMILL_PACKED_CACHE", "0")
    assert torch.equal(first, second) and torch.equal(second, logits(path))
    assert len(caches) == 2


def test_a_changed_file_replaces_its_cache(tmp_path, caches):
    path = model_file(tmp_path / "m.gguf")
    before = logits(path)
    os.utime(path, ns=(0, 0))  # same bytes, another mtime: another key
    model_file(tmp_path / "m.gguf", seed=1)
    after = logits(path)
    assert not caches[1].hit and not torch.equal(before, after)
    assert len(list(packed_cache.folder().glob("*.bin"))) == 1  # the older one removed
    assert torch.equal(after, logits(path)) and caches[2].hit


def test_a_cache_that_does_not_match_is_not_used(tmp_path, caches):
    path = model_file(tmp_path / "m.gguf")
    expected = logits(path)
    index = next(packed_cache.folder().glob("*.json"))
    entries = json.loads(index.read_text())
    entries["entries"][3][0] = "another tensor"
    index.write_text(json.dumps(entries))
    assert torch.equal(logits(path), expected)  # packed from the fourth matrix on
    assert caches[1].hit and caches[1].broken and caches[1]._next == 3
    data = next(packed_cache.folder().glob("*.bin"))
    os.truncate(data, 4096)  # shorter than its index says: not a hit
    assert torch.equal(logits(path), expected) and not caches[2].hit
    index.write_text(json.dumps({"entries": [["a", -1, 5]]}))  # nonsense: not a hit
    assert torch.equal(logits(path), expected) and not caches[3].hit


def test_a_load_that_fails_leaves_no_cache(tmp_path, caches, monkeypatch):
    from tokenmill.models.llama import LlamaForCausalLM

    path = model_file(tmp_path / "m.gguf")
    loaded = LlamaForCausalLM.load_weights

    def fail_midway(self, weights):
        def some():
            for i, item in enumerate(weights):
                if i == 12:
                    raise ValueError("a bad tensor")
                yield item
        loaded(self, some())

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", fail_midway)
    with pytest.raises(ValueError, match="a bad tensor"):
        logits(path)
    assert caches[0].entries and list(packed_cache.folder().iterdir()) == []


def test_no_cache_that_would_fill_the_disk(tmp_path, caches, monkeypatch):
    import shutil

    path = model_file(tmp_path / "m.gguf")
    usage = shutil.disk_usage(tmp_path)
    full = usage._replace(free=(1 << 30) + os.path.getsize(path))  # 1 GiB left after it
    monkeypatch.setattr(shutil, "disk_usage", lambda where: full._replace(total=1 << 40))
    expected = logits(path)
    assert caches[0].broken and list(packed_cache.folder().iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda where: full._replace(total=1 << 30))
    assert torch.equal(logits(path), expected) and not caches[1].broken


def test_without_a_writable_folder_it_packs(tmp_path, caches, monkeypatch):
    path = model_file(tmp_path / "m.gguf")
    (tmp_path / "home").write_text("a file where the folder would be")
    expected = logits(path)
    assert caches[0].broken
    monkeypatch.setenv("TOKENMILL_PACKED_CACHE", "0")
    assert torch.equal(logits(path), expected) and len(caches) == 1
