"""Prompt rows on quantized weights: the rows a step marks as prompt tokens (ModelRunner's
_prompt_rows) and what the kernels do with them (on the AMX build, bf16 rows times the weights
dequantized to bf16: tm.h, tm_linear_fwd). A row's path follows its request and position only,
so prompts give the same numbers however they are chunked, fused or not; generated tokens keep
the int8 path."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine import model_runner
from tokenmill.engine.model_runner import PROMPT_ROWS_FROM, _prompt_rows
from tokenmill.engine.sequence import Sequence
from tokenmill.layers import ops


class Seq:  # what _prompt_rows reads of a scheduled sequence
    runs_as_decode = Sequence.runs_as_decode

    def __init__(self, prompt: int, computed: int, spec: bool = False) -> None:
        self.num_prompt_tokens, self.num_computed_tokens = prompt, computed
        self.spec_token_ids = [7] if spec else []


def test_prompt_rows_follow_the_prompt_tokens():
    long, short = PROMPT_ROWS_FROM + 40, PROMPT_ROWS_FROM - 1
    scheduled = [
        (Seq(long, long + 2), 1),  # a decode row: stays int8
        (Seq(long, long + 5, spec=True), 5),  # verify rows
        (Seq(long, 0), 32),  # a first chunk
        (Seq(long, 64), 32),  # a chunk across the prompt's end: its first 24 rows
        (Seq(short, 0), 20),  # a short prompt: int8
        (Seq(long, long + 3), 9),  # a preempted sequence's recomputed output
        (Seq(long, 32), 16),  # a middle chunk
        (Seq(long, long - 1), 1),  # the prompt's last token alone: a one-token chunk
    ]
    order = [0, 1, 2, 3, 4, 5, 6, 7]
    starts = [0, 1, 6, 38, 70, 90, 99, 115]
    assert _prompt_rows(scheduled, order, starts) == [(6, 62), (99, 116)]
    assert _prompt_rows(scheduled[:2], [0, 1], [0, 1]) == []


pytestmark = pytest.mark.skipif(
    not (ops.available() and ops.select(True, torch.device("cpu")).quantized_kernels),
    reason="the kernels here have no fast quantized path")


def outputs(path, monkeypatch, chunk: int, prompts, fused: bool = True, rows_from=None,
            seqs: int = 256):
    from tokenmill.models import llama

    with monkeypatch.context() as m:
        if not fused:
            m.setattr(llama.LlamaModel, "_fused_decoder", lambda *a: None)
        if rows_from is not None:
            m.setattr(model_runner, "PROMPT_ROWS_FROM", rows_from)
        llm = LLM(str(path), dtype="bfloat16", quantization="int4", max_num_batched_tokens=chunk,
                  enable_prefix_caching=False, max_num_seqs=seqs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                                           prompt_logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs],
             [d and {k: v.logprob for k, v in d.items()} for d in o.prompt_logprobs])
            for o in outs]


def test_prompts_are_the_same_however_chunked_and_fused(tmp_path, monkeypatch):
    """An int4 tiny Llama in bf16, prompts of 3-130 tokens (both sides of PROMPT_ROWS_FROM):
    chunks of 16 or of 256 tokens, the fused step or layer by layer give identical tokens,
    logprobs and prompt logprobs. On the AMX build the prompt rows really take the other path:
    with PROMPT_ROWS_FROM out of reach the long prompts' numbers change (elsewhere they do
    not)."""
    from tokenmill.kernels import load_cpu_kernels

    save_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    prompts = random_prompts(5, 3, 130, seed=3) + [random_prompts(1, 100, 101, seed=4)[0]]
    want = outputs(tmp_path, monkeypatch, 256, prompts)
    assert outputs(tmp_path, monkeypatch, 16, prompts) == want
    assert outputs(tmp_path, monkeypatch, 16, prompts, fused=False) == want
    int8 = outputs(tmp_path, monkeypatch, 256, prompts, rows_from=10**9)
    amx = load_cpu_kernels().isa == "amx"
    for p, a, b in zip(prompts, want, int8):
        assert (a[2] != b[2]) == (amx and len(p) >= PROMPT_ROWS_FROM), len(p)


def test_a_prompts_one_token_chunk_is_a_chunk(tmp_path, monkeypatch):
    """Prompts of 9 and 17 tokens in chunks of 8 end in a one-token chunk. It runs as a prefill
    chunk, not as a decode row (the decode and prefill attention kernels sum in different
    orders), so the numbers are those of the prompt in one chunk."""
    save_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    prompts = random_prompts(3, 9, 9, seed=5) + random_prompts(3, 17, 17, seed=6)
    want = outputs(tmp_path, monkeypatch, 256, prompts, seqs=1)
    assert outputs(tmp_path, monkeypatch, 8, prompts, seqs=1) == want
