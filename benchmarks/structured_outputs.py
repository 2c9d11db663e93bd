"""What structured outputs cost, on the default model.

1. Neighbours: 16 concurrent chat requests, 8 constrained by a JSON schema and 8 free. The
   free half's output tokens per second, against a run where the other 8 have no masks but
   generate exactly as many tokens each (the same batch at every step, only the masks
   differ). Rounds alternate the two; medians. Also the mask work per row and how much of it
   the forward pass did not hide (time the sampler waited).
2. Grammar engines: llguidance (what tokenmill uses) against xgrammar when it is importable,
   on the 20 schemas of tests/test_structured_smollm2.py: compile time and mask time per
   token, replaying the tokens the model wrote under llguidance.

    python benchmarks/structured_outputs.py [--model smollm2-135m-instruct] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit_json, machine, print_table  # noqa: E402
from tests.test_structured_smollm2 import SCHEMAS  # noqa: E402


def run_batch(engine, prompts, params) -> tuple[list, float]:
    """All requests at once; (outputs, seconds until the free half is done)."""
    start = time.perf_counter()
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done, free_done = {}, None
    free = {ids[i] for i, sp in enumerate(params) if sp.structured_outputs is None
            and sp.ignore_eos}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if free_done is None and free <= done.keys():
            free_done = time.perf_counter() - start
    return [done[i] for i in ids], free_done


def neighbours(model: str, rounds: int) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=16)
    engine = llm.engine
    prompts = [llm.chat_prompt([{"role": "user", "content": f"Describe {w} in JSON."}])
               for w, _ in SCHEMAS[:8]]
    prompts += [llm.chat_prompt([{"role": "user", "content": f"Tell a story about {w}."}])
                for w, _ in SCHEMAS[8:16]]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=128, ignore_eos=True)
            for i in range(8)]
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=400,
                                  structured_outputs={"json": s}) for i, (_, s) in
                   enumerate(SCHEMAS[:8])]
    outs, _ = run_batch(engine, prompts, constrained + free)  # warm-up, and the lengths
    lengths = [len(o.outputs[0].token_ids) for o in outs[:8]]
    unmasked = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
                for i, n in enumerate(lengths)]
    tokens = 8 * 128
    times = {"masked": [], "unmasked": []}
    so = engine.structured
    rows0, mask0, wait0 = so.mask_rows, so.mask_seconds, so.wait_seconds
    for _ in range(rounds):
        for name, other in (("masked", constrained), ("unmasked", unmasked)):
            _, seconds = run_batch(engine, prompts, other + free)
            times[name].append(seconds)
            print(f"  {name}: free half done in {seconds:.2f} s", flush=True)
    rows = so.mask_rows - rows0
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "free_tok_s_masked": tokens / med["masked"],
        "free_tok_s_unmasked": tokens / med["unmasked"],
        "ratio": med["unmasked"] / med["masked"],
        "constrained_tokens": lengths,
        "mask_us_per_row": 1e6 * (so.mask_seconds - mask0) / max(rows, 1),
        "wait_us_per_row": 1e6 * (so.wait_seconds - wait0) / max(rows, 1),
    }


def recorded_tokens(model: str) -> tuple[object, list[list[int]]]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=20)
    convs = [[{"role": "user", "content": f"Describe {w} in JSON."}] for w, _ in SCHEMAS]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=400,
                             structured_outputs={"json": s}) for i, (_, s) in
              enumerate(SCHEMAS)]
    outs = [llm.chat([c], p, use_tqdm=False)[0] for c, p in zip(convs, params)]
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def time_llguidance(llm, runs) -> dict:
    import llguidance
    import torch

    from tokenmill.structured_outputs import StructuredOutputsParams

    so = llm.engine.structured
    _, tok, executor = so._llg
    compile_s, mask_s, n = [], 0.0, 0
    bitmask = torch.empty((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
    for (_, schema), tokens in zip(SCHEMAS, runs):
        spec = StructuredOutputsParams(json=schema).grammar_spec()
        start = time.perf_counter()
        m = llguidance.LLMatcher(tok, spec, log_level=0)
        compile_s.append(time.perf_counter() - start)
        for t in tokens:
            start = time.perf_counter()
            executor.unsafe_compute_mask_ptr([(m, 0)], bitmask.data_ptr(), bitmask.shape[1] * 4,
                                             1)
            mask_s += time.perf_counter() - start
            n += 1
            m.consume_token(t)
    return {"engine": "llguidance", "compile_ms": 1e3 * statistics.median(compile_s),
            "mask_us_per_token": 1e6 * mask_s / n, "tokens": n, "rejected": 0}


def time_xgrammar(llm, runs) -> dict | None:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return None
    from tokenmill.structured_outputs import closed_objects

    tok = llm.engine.tokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=llm.engine.model_config.vocab_size,
                                              stop_token_ids=tok.eos_token_ids)
    setup_s = time.perf_counter() - start
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compile_s, mask_s, n, rejected = [], 0.0, 0, 0
    for (_, schema), tokens in zip(SCHEMAS, runs):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(closed_objects(schema)),
                                                any_whitespace=False)
        m = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - start)
        for t in tokens:
            start = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            mask_s += time.perf_counter() - start
            n += 1
            if not m.accept_token(t):
                rejected += 1
                break
    return {"engine": "xgrammar", "compile_ms": 1e3 * statistics.median(compile_s),
            "mask_us_per_token": 1e6 * mask_s / max(n, 1), "tokens": n, "rejected": rejected,
            "tokenizer_setup_s": setup_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    result = {"benchmark": "structured_outputs", "machine": machine(), "model": args.model}
    result["neighbours"] = n = neighbours(args.model, args.rounds)
    print("16 concurrent requests; the 8 free ones' output tok/s:")
    print_table([{"other 8": "JSON-schema masks", "free tok/s": n["free_tok_s_masked"]},
                 {"other 8": "no masks (same lengths)", "free tok/s": n["free_tok_s_unmasked"]}],
                ["other 8", "free tok/s"])
    print(f"ratio {n['ratio']:.3f}; mask {n['mask_us_per_row']:.0f} us per row, sampler "
          f"waited {n['wait_us_per_row']:.0f} us per row\n")
    llm, runs = recorded_tokens(args.model)
    engines = [time_llguidance(llm, runs), time_xgrammar(llm, runs)]
    result["engines"] = [e for e in engines if e is not None]
    print_table(result["engines"], ["engine", "compile_ms", "mask_us_per_token", "tokens",
                                    "rejected"])
    if engines[1] is None:
        print("xgrammar is not installed: only llguidance measured")
    emit_json(result)


if __name__ == "__main__":
    main()
