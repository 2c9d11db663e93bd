"""GPT-2 against transformers (the oracle), and the GPT-2 tokenizer.json fixture."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
PROMPT = [5, 17, 200, 3, 99, 42, 7, 250, 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random GPT2LMHeadModel saved as safetensors, and tokenmill loading that folder."""
    torch.manual_seed(0)
    # eos None: greedy decoding must not stop early on either side; a wide init keeps the
    # greedy continuation from collapsing into one repeated token.
    config = transformers.GPT2Config(vocab_size=300, n_positions=128, n_embd=64, n_layer=2,
                                     n_head=4, eos_token_id=None, bos_token_id=None,
                                     initializer_range=0.2)
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    return model, LLM(str(folder), dtype="float32", max_num_seqs=2)


def test_logits_match(pair):
    model, llm = pair
    ours = llm.engine.compute_logits(PROMPT)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    assert (ours[-1] - ref[-1]).abs().max().item() < 1e-4


def test_greedy_32_tokens_match(pair):
    model, llm = pair
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=32),
                       use_tqdm=False)[0].outputs[0].token_ids
    ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=32,
                         pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(set(ref)) > 4  # a continuation that actually exercises the model
    assert list(out) == ref


def test_conv1d_weights_are_transposed(pair):
    model, llm = pair
    ours = llm.engine.runner.model.transformer.h[0].attn.c_attn.rows()  # dropped: rebuilt
    assert torch.equal(ours, model.transformer.h[0].attn.c_attn.weight.t())


def test_tokenizer_fixture(fixtures):
    folder = fixtures / "tokenizers" / "gpt2"
    tok = Tokenizer.from_folder(str(folder))
    assert tok.encode("Hello world!") == [15496, 995, 0]
    assert tok.decode([15496, 995, 0]) == "Hello world!"
    assert len(json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]) == 50000
