"""The rotary table is computed as far as the positions reach (layers/rotary.py): its rows
equal the formula's however far and in what steps it was filled, and a model reading positions
past the first chunk (the engine extending the table as it goes) matches transformers."""

from __future__ import annotations

import torch

from tests.conftest import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.layers.rotary import FILL_CHUNK, RotaryEmbedding, rope_inv_freq


def test_rows_do_not_depend_on_how_the_table_was_filled():
    scaling = {"rope_type": "linear", "factor": 2.0}
    positions = 3 * FILL_CHUNK + 100
    steps, whole = (RotaryEmbedding(64, positions, 10000.0, scaling) for _ in range(2))
    assert steps.filled == FILL_CHUNK
    for reach in (10, FILL_CHUNK + 1, FILL_CHUNK + 2, positions):
        steps.ensure(reach)
        assert steps.filled == min(positions, -(-reach // FILL_CHUNK) * FILL_CHUNK)
    whole.ensure(positions)
    assert torch.equal(steps.cos_sin, whole.cos_sin)
    freqs = torch.arange(positions).float()[:, None] * rope_inv_freq(64, 10000.0, scaling)
    assert torch.allclose(whole.cos_sin, torch.stack((freqs.cos(), freqs.sin())), atol=1e-6)


def test_positions_past_the_first_chunk_match_transformers(tmp_path):
    hf = save_tiny_model(tmp_path, "llama", max_position_embeddings=2 * FILL_CHUNK + 64)
    prompt = [int(t) for t in torch.randint(0, 256, (FILL_CHUNK + 40,),
                                            generator=torch.Generator().manual_seed(3))]
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=1, max_model_len=FILL_CHUNK + 64)
    rotary = next(m for m in llm.engine.runner.model.modules()
                  if isinstance(m, RotaryEmbedding))
    assert rotary.filled == FILL_CHUNK  # the rest is not computed until a step reaches it
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=4, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert rotary.filled == rotary.max_positions > FILL_CHUNK  # the engine's max_model_len
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
    assert out.token_ids == want.sequences[0, len(prompt):].tolist()
    for step, (token, scores) in enumerate(zip(out.token_ids, want.scores)):
        expected = scores[0].log_softmax(-1)[token].item()
        assert abs(out.logprobs[step][token].logprob - expected) < 1e-4
