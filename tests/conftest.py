"""Shared test helpers: where the fixtures live and tiny random checkpoints made with
transformers (the numerical oracle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def fixtures_dir() -> Path | None:
    candidates = [os.environ.get("TOKENMILL_FIXTURES"), REPO.parent / "shared" / "fixtures",
                  "/work/shared/fixtures"]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


@pytest.fixture(scope="session")
def fixtures() -> Path:
    path = fixtures_dir()
    if path is None:
        pytest.skip("shared fixtures folder not found (set TOKENMILL_FIXTURES)")
    return path


def tiny_config(arch: str, **overrides):
    """A small config of the given family; vocab 256, eos disabled so greedy runs full length."""
    import transformers

    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.05,
    )
    base.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    return cls(**base)


def save_tiny_model(path: Path, arch: str, seed: int = 0, **overrides):
    """Save a random model of the family to path; returns the transformers model (float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(path, hf_model) of a tiny GQA Llama shared by the engine tests."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_model(path, "llama")


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


def random_prompts(
    count: int, lo: int, hi: int, vocab: int = 256, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
