"""MLA decode: the absorbed form (queries projected into latent space, attention over the cached
latents) against the expanded form (every cached latent turned into per-head K and V each
step), and a same-width Llama with a plain K/V cache, at a given context.

The model is a random DeepSeek-V3-shaped checkpoint made here (transformers builds and saves
it), scaled down to run on a laptop CPU: hidden 1024, 16 heads of 128 + 64 RoPE dims, kv_lora_rank
256, 4 layers, dense MLPs only (first_k_dense_replace = layers), float32. Each measurement is the
mean step time of 32 decode steps of 4 sequences after a prefill of `--context` tokens each.
Prints a table and ends with one JSON line.

    python benchmarks/mla_decode.py [--context 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit_json, machine, print_table  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, vocab_size=1024,
             num_attention_heads=16)


def make_models(folder: Path) -> dict[str, str]:
    import torch
    import transformers

    torch.manual_seed(0)
    ds = transformers.DeepseekV3Config(
        **SHAPE, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=256, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=4,
        max_position_embeddings=40000, eos_token_id=None, bos_token_id=None)
    llama = transformers.LlamaConfig(**SHAPE, num_key_value_heads=16, head_dim=128,
                                     max_position_embeddings=40000, eos_token_id=None)
    paths = {}
    for name, cfg, cls in (("deepseek", ds, transformers.DeepseekV3ForCausalLM),
                           ("llama", llama, transformers.LlamaForCausalLM)):
        paths[name] = str(folder / name)
        cls(cfg).save_pretrained(paths[name])
    return paths


def step_time(path: str, context: int, absorb: bool | None,
              kernel: bool = True) -> tuple[float, int]:
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.ops import TorchOps

    llm = LLM(path, dtype="float32", max_model_len=context + 64, max_num_seqs=4,
              enable_prefix_caching=False, kv_cache_memory=None)
    for module in llm.engine.runner.model.modules():
        if absorb is not None and hasattr(module, "absorb"):
            module.absorb = absorb
            if not kernel:  # the latent attention in PyTorch einsums (the portable path)
                module.ops = TorchOps()
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 1000 for j in range(context)]}
               for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    engine = llm.engine
    for p in prompts:
        engine.add_request(None, p, SamplingParams(max_tokens=33, ignore_eos=True, temperature=0))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # prefills, and the first token
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps, engine.kv_plan.bytes_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_models(Path(tmp))
        settings = {"MLA absorbed, C++ kernel": (paths["deepseek"], True, True),
                    "MLA absorbed, PyTorch einsums": (paths["deepseek"], True, False),
                    "MLA expanded": (paths["deepseek"], False, True),
                    "Llama, K/V cache": (paths["llama"], None, True)}
        times = {name: [] for name in settings}
        per_token = {}
        for _ in range(args.rounds):
            for name, (path, absorb, kernel) in settings.items():
                t, per_token[name] = step_time(path, args.context, absorb, kernel)
                times[name].append(t)
    rows = [{"decode": name, "step_ms": 1e3 * statistics.median(v),
             "kv_bytes_per_token": per_token[name]} for name, v in times.items()]
    print(f"4 sequences x {args.context} tokens of context, float32, 2 threads")
    print_table(rows, ["decode", "step_ms", "kv_bytes_per_token"])
    emit_json({"benchmark": "mla_decode", "machine": machine(), "context": args.context,
               "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
