"""GGUF files of the Llama-family architectures beyond llama/qwen2, written from tiny random
checkpoints the way llama.cpp's converter writes them: Qwen3 (q/k norms), Llama 3.x (RoPE
scaling as a rope_freqs tensor) and Mistral (a sliding window in the metadata). Oracles: the
original transformers model, and transformers loading the same GGUF where it reads the
architecture."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.conftest import random_prompts, save_tiny_model
from tests.gguf_util import write_gguf
from tokenmill import LLM
from tokenmill.loaders.gguf import load_gguf
from tokenmill.models.registry import SUPPORTED_GGUF_ARCHITECTURES

transformers = pytest.importorskip("transformers")
IDS = random_prompts(1, 40, 40, seed=11)[0]
# with head_dim 16: wavelengths 6 and 11 unscaled, 20, 35 and 63 smoothed, the rest / 8
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def logits(path) -> torch.Tensor:
    return LLM(str(path), dtype="float32", max_model_len=128).engine.compute_logits(IDS)


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama-3 RoPE scaling (its
    LlamaModel.generate_extra_tensors): one divisor per frequency."""
    base, factor = rope["rope_theta"], rope["factor"]
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen
                      - rope["low_freq_factor"]) / (rope["high_freq_factor"]
                                                    - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_qwen3_file_with_wide_heads_matches_checkpoint(tmp_path):
    """head_dim 32 with hidden 64 / 4 heads: read from attention.key_length."""
    hf = save_tiny_model(tmp_path / "hf", "qwen3", head_dim=32, seed=3)
    write_gguf(tmp_path / "q.gguf", "qwen3", hf.config, hf.state_dict())
    _, cfg, _ = load_gguf(str(tmp_path / "q.gguf"), "float32", torch.device("cpu"), 64)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 32
    assert (logits(tmp_path / "q.gguf") - hf_logits(hf)).abs().max().item() < 1e-4


def test_quantized_qwen3_file_matches_transformers(tmp_path):
    """transformers' GGUF reader takes head_dim as hidden / heads: the tiny model has that."""
    hf = save_tiny_model(tmp_path / "hf", "qwen3", seed=3)
    write_gguf(tmp_path / "q.gguf", "qwen3", hf.config, hf.state_dict(),
               {"attn_q.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_0, "ffn_down.weight": Q.Q5_1})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="q.gguf", dtype=torch.float32).eval()
    assert (logits(tmp_path / "q.gguf") - hf_logits(theirs)).abs().max().item() < 1e-4


def test_llama3_rope_freqs_file_matches_checkpoint(tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "llama", rope_parameters=LLAMA3_ROPE, seed=4)
    freqs = llama_cpp_rope_freqs(LLAMA3_ROPE, 16)
    assert len(set(freqs.round(4).tolist())) > 2  # low, high and smoothed frequencies
    write_gguf(tmp_path / "l.gguf", "llama", hf.config, hf.state_dict(),
               extra=lambda w: w.add_tensor("rope_freqs.weight", freqs))
    _, cfg, _ = load_gguf(str(tmp_path / "l.gguf"), "float32", torch.device("cpu"), 64)
    assert cfg.rope_scaling["rope_type"] == "freq_factors"
    assert (logits(tmp_path / "l.gguf") - hf_logits(hf)).abs().max().item() < 1e-4


def test_rope_freqs_of_the_wrong_length_is_a_clear_error(tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "llama", seed=4)
    write_gguf(tmp_path / "l.gguf", "llama", hf.config, hf.state_dict(),
               extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(5, np.float32)))
    with pytest.raises(ValueError, match="rope_freqs has 5 factors, expected 8"):
        logits(tmp_path / "l.gguf")


def test_mistral_sliding_window_in_metadata(tmp_path):
    """A Mistral file is `llama` with the window as {arch}.attention.sliding_window."""
    hf = save_tiny_model(tmp_path / "hf", "mistral", sliding_window=8, seed=5)
    write_gguf(tmp_path / "m.gguf", "llama", hf.config, hf.state_dict(),
               extra=lambda w: w.add_sliding_window(8))
    _, cfg, _ = load_gguf(str(tmp_path / "m.gguf"), "float32", torch.device("cpu"), 64)
    assert cfg.sliding_window_for(0) == 8
    assert (logits(tmp_path / "m.gguf") - hf_logits(hf)).abs().max().item() < 1e-4


def test_supported_gguf_architectures_are_named():
    assert {"llama", "qwen2", "qwen3", "gemma3"} <= set(SUPPORTED_GGUF_ARCHITECTURES)


# A Llama 3.x-style template (the header/eot format of Meta's, with its system preamble,
# date from strftime_now, tools as JSON in the first user turn, tool results as ipython).
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if loop.first and tools is not none and message['role'] == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif message['role'] == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message['content']
            + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]])
def test_llama3_chat_template_renders_like_transformers(tools):
    from transformers.utils.chat_template_utils import render_jinja_template

    from tokenmill.tokenizer import render_chat_template

    messages = [{"role": "system", "content": "Be brief. "},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "tool", "content": '{"temp": 21}'},
                {"role": "user", "content": "And in Rome?"}]
    kwargs = dict(bos_token="<|begin_of_text|>", date_string="01 Dec 2026")
    ours = render_chat_template(LLAMA3_TEMPLATE, messages, tools=tools,
                                add_generation_prompt=True, **kwargs)
    theirs = render_jinja_template([messages], tools=tools, chat_template=LLAMA3_TEMPLATE,
                                   add_generation_prompt=True, **kwargs)[0][0]
    assert ours == theirs
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ("get_weather" in ours) == (tools is not None)
