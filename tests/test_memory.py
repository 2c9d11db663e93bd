"""Memory the way users expect (engine/memory.py): the KV pool is resident only where tokens
were written, a budget or context that cannot fit is a one-line error at start, the engine
reports its memory plan, and loading a GGUF file does not hold the whole file and its
converted copy at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.memory import NotEnoughMemory, available_memory, peak_rss, rss
from tokenmill.layers.kv_cache import zeros

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


def test_available_memory_is_what_the_kernel_reports():
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_memory() <= total
    assert 0 < rss() <= peak_rss()


def test_kv_pool_is_resident_only_where_written():
    before = rss()
    pool = zeros((30, 2**25), torch.bfloat16, torch.device("cpu"))  # 30 "layers" x 64 MiB
    assert rss() - before < 16 * MiB  # nothing written, nothing resident
    pool[:, :8192] = 1  # 16 KiB at the start of each layer: what a short request writes
    grown = rss() - before
    # 30 x 16 KiB = 480 KiB; one 2 MiB huge page per layer would be 60 MiB
    assert grown < 8 * MiB, f"{grown / MiB:.1f} MiB resident for 0.5 MiB written"
    assert pool.sum().item() == 30 * 8192


def test_engine_reports_its_memory_plan(tiny_model):
    llm = LLM(tiny_model, dtype="float32", kv_cache_memory=64 * MiB)
    m, plan = llm.engine.memory, llm.engine.kv_plan
    assert m.kv_budget == plan.nbytes <= 64 * MiB
    assert m.kv_tokens == plan.num_tokens and m.kv_bytes_per_token == plan.bytes_per_token
    assert m.max_full_sequences == plan.num_tokens // plan.max_model_len >= 1
    assert 0 < m.rss <= m.peak_rss and m.available > 0
    assert f"{plan.num_tokens} tokens" in m.describe()
    stats = llm.engine.stats()
    assert stats["kv_cache_used_bytes"] == 0
    llm.generate(["hello there"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.stats()["kv_cache_used_bytes"] == 0  # every block freed again


def test_kv_budget_larger_than_memory_is_refused(tiny_model):
    too_much = available_memory() + 2**30
    with pytest.raises(NotEnoughMemory, match="kv_cache_memory .* is more than the available"):
        LLM(tiny_model, dtype="float32", kv_cache_memory=too_much)


def test_context_the_budget_cannot_hold_is_refused(tiny_model):
    with pytest.raises(NotEnoughMemory, match="max_model_len \\(512\\) needs"):
        LLM(tiny_model, dtype="float32", max_model_len=512, kv_cache_memory=64 * 1024)
    # without an explicit max_model_len the engine lowers it to what fits instead
    llm = LLM(tiny_model, dtype="float32", kv_cache_memory=64 * 1024)
    assert llm.engine.config.max_model_len == llm.engine.kv_plan.num_tokens < 512


def test_cli_exits_at_once_naming_the_numbers(tiny_model, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENMILL_HOME=str(tmp_path))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "generate", tiny_model, "hi",
                           "--kv-cache-memory", "100TiB"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "102400.0 GiB" in lines[0]
    assert "available memory" in lines[0] and "--kv-cache-memory" in lines[0]


LOAD_SCRIPT = """
import json, sys
from tokenmill.engine.memory import rss
from tokenmill import LLM
base = rss()
llm = LLM(sys.argv[1])
print(json.dumps({"base": base, "rss": llm.engine.memory.rss,
                  "peak": llm.engine.memory.peak_rss}))
"""


@pytest.mark.smollm2
def test_gguf_load_peak_stays_near_the_final_size(default_model):
    path = default_model
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, path], capture_output=True,
                         text=True, env=env, timeout=300, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["peak"] <= 1.5 * m["rss"]
    # what loading added at its peak vs what stays: the file's pages are let go tensor by
    # tensor (all of them at the end, this was 2.2x: 268 vs 122 MiB)
    assert m["peak"] - m["base"] <= 1.8 * (m["rss"] - m["base"]), m


FLOAT_LOAD_SCRIPT = """
import json, sys
from tokenmill.engine.memory import rss
from tokenmill import LLM
base = rss()
llm = LLM(sys.argv[1], max_model_len=256, max_num_seqs=2)
print(json.dumps({"base": base, "rss": llm.engine.memory.rss,
                  "peak": llm.engine.memory.peak_rss}))
"""


def test_float_load_peak_stays_near_the_final_size(tmp_path):
    """A BF16 checkpoint (~90 MB, a tied head): packing gives each layer's rows back as it goes
    (the panels come from fresh mappings, not the heap's free lists: holding every row and every
    panel at once made the BF16 SmolLM2 folder's start-up peak 883 MiB against 687)."""
    import transformers

    from tests.conftest import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=16384,
                      tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", FLOAT_LOAD_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["peak"] - m["base"] <= 1.4 * (m["rss"] - m["base"]), m


def test_bf16_gguf_load_peak_stays_near_the_final_size(tmp_path):
    """A BF16 GGUF with a large tied embedding (64 MiB): its matrices reach the model as bf16
    bits, not float32 copies (Gemma-3-270M's 335 MB embedding made a 2.4 GB start-up peak for a
    1.1 GB process that way; now 1.4 GB), and the file's pages go before the model copies it."""
    import transformers

    from tests.conftest import tiny_config
    from tests.gguf_util import Q, write_gguf

    torch.manual_seed(0)
    cfg = tiny_config("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=65536,
                      tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    types = {s: Q.BF16 for s in ("token_embd.weight", "attn_q.weight", "attn_k.weight",
                                 "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                                 "ffn_up.weight", "ffn_down.weight")}
    write_gguf(tmp_path / "m.gguf", "llama", cfg, state, types)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", FLOAT_LOAD_SCRIPT, str(tmp_path / "m.gguf")],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["peak"] - m["base"] <= 2.2 * (m["rss"] - m["base"]), m  # 4.6 through float32


def test_model_check_counts_only_the_files_it_loads(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    with open(folder / "pytorch_model.bin", "wb") as f:  # sparse: takes no disk
        f.truncate(available_memory() + 2**30)
    LLM(str(folder), dtype="float32", kv_cache_memory=MiB)  # never reads the .bin
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(available_memory() + 2**30)
    with pytest.raises(NotEnoughMemory, match="do not fit in the available memory"):
        LLM(str(folder), dtype="float32", kv_cache_memory=MiB)
