"""The public API's edges: clear ValueErrors naming the parameter, loading rules (no pickle,
sharded safetensors, unknown architectures), the progress bar, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, hf_greedy, save_tiny_model
from tokenmill import LLM, SamplingParams

BAD_PARAMS = [
    ({"temperature": -0.1}, "temperature must be in"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"top_p": 1.5}, "top_p must be in"),
    ({"top_k": -2}, "top_k must be"),
    ({"min_p": 2.0}, "min_p must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"presence_penalty": 3.0}, "presence_penalty must be in"),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
    ({"n": 0}, "n must be"),
    ({"max_tokens": 0}, "max_tokens must be"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 21}, "logprobs must be"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be"),
    ({"stop": [""]}, "stop must be"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": "x"}, "seed must be"),
    ({"temperature": "hot"}, "temperature must be in"),
]


@pytest.mark.parametrize("kwargs,message", BAD_PARAMS)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), dtype="float32", max_model_len=64)


def test_engine_config_validation(tiny_llama):
    path = str(tiny_llama[0])
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        LLM(path, block_size=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(path, dtype="float8")
    with pytest.raises(ValueError, match="max_model_len .* exceeds"):
        LLM(path, max_model_len=100_000)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLM(path, kv_cache_memory=100)
    with pytest.raises(TypeError, match="unknown arguments: colour"):
        LLM(path, colour="blue")


def test_bad_prompts_are_rejected_and_engine_keeps_going(llm):
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": [1] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 256\)"):
        llm.generate({"prompt_token_ids": [1, 999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": [3] * 60}, SamplingParams(max_tokens=None),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_progress_bar(llm, capsys):
    llm.generate([{"prompt_token_ids": [1, 2]}] * 2, SamplingParams(max_tokens=2))
    assert "Generating" in capsys.readouterr().err
    llm.generate([{"prompt_token_ids": [1, 2]}] * 2, SamplingParams(max_tokens=2),
                 use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ValueError, match="never loaded"):
        LLM(str(tmp_path))


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match="supported architectures: LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_config_without_architectures_uses_model_type(tmp_path):
    hf = save_tiny_model(tmp_path, "qwen2", seed=6)  # Qwen2: QKV biases, a model_type to map
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]  # as transformers writes a config converted from a GGUF
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.model_config.architecture == "Qwen2ForCausalLM"
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0,
                       max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, [4, 5, 6], 8)


def test_sharded_checkpoint(tmp_path):
    hf = save_tiny_model(tmp_path, "llama", seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), dtype="float32")
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0,
                       max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, [4, 5, 6], 8)


def test_bfloat16_runs_close_to_float32(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(str(path), dtype="bfloat16")
    prompt = [5, 9, 13, 17, 21]
    ours = llm.engine.compute_logits(prompt)[-1]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (ours - ref).abs().max().item() < 0.05


def test_cli_reports_errors_in_one_line(tmp_path):
    env_cmd = [sys.executable, "-m", "tokenmill", "generate", str(tmp_path / "missing"), "hi"]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("tokenmill generate: error:")
    assert "Traceback" not in proc.stderr
