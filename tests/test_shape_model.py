"""benchmarks/shape_model.py: the skeleton holds no weights, and the model filled from it has
exactly the BF16 model's tensors (names, shapes, types) and metadata with other values, and
runs."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from benchmarks import shape_model
from benchmarks.bf16_model import bf16_gguf
from tests.gguf_util import write_gguf
from tests.test_gguf_loader import IDS, tiny
from tokenmill import LLM, SamplingParams


def specs(reader):
    return [(t.name, [int(d) for d in t.shape], t.tensor_type) for t in reader.tensors]


def test_random_weights_of_the_same_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    model = tiny("llama", tie=False)
    src = tmp_path / "m.gguf"
    write_gguf(src, "llama", model.config, model.state_dict(), {"attn_q.weight": Q.Q8_0})
    skel = tmp_path / "skel.gguf"
    shape_model.skeleton(skel, str(src))
    bf16 = bf16_gguf(str(src))
    assert skel.stat().st_size < bf16.stat().st_size / 10  # metadata only

    out = shape_model.fill(skel)
    assert out.parent == bf16.parent and out != bf16
    real, rand = gguf.GGUFReader(str(bf16)), gguf.GGUFReader(str(out))
    assert specs(rand) == specs(real) and any(t.tensor_type == Q.BF16 for t in rand.tensors)
    names = {f for f in real.fields if not f.startswith("GGUF.")} | {"general.name"}
    assert {f for f in rand.fields if not f.startswith("GGUF.")} == names
    assert "random weights" in str(rand.fields["general.name"].contents())
    for a, b in zip(real.tensors, rand.tensors):
        if len(a.shape) > 1:
            assert not np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name

    llm = LLM(str(out), max_model_len=64, max_num_seqs=1)
    result = llm.generate({"prompt_token_ids": IDS},
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(result.outputs[0].token_ids) == 4
