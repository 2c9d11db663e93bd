"""DeepSeek V4's compressed attention against full attention: decode step time and KV bytes
held as the context grows (1K ... 32K tokens), one sequence.

Both models are random checkpoints made here (transformers builds and saves them) with the
same width: hidden 512, 8 query heads of 64 dims, 4 layers, float32. V4 runs CSA and HCA in
turn with DeepSeek's rates (one entry per 4 and per 128 tokens), a 128-token window, an
indexer of 8 heads x 64 keeping 512 entries; its MoE has 4 experts of 256 (2 routed per
token). The Llama has a plain K/V cache of 8 KV heads and a 1,024-wide MLP. Each point is the
median of 32 decode steps after the prompt was prefilled in 2,048-token chunks. Prints a table,
saves a PNG of both curves, ends with one JSON line.

    python benchmarks/v4_decode.py [--contexts 1024,2048,...] [--plot docs/images/v4-decode.png]
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

WIDTH = dict(hidden_size=512, num_attention_heads=8, head_dim=64, num_hidden_layers=4,
             vocab_size=1024, max_position_embeddings=40000, eos_token_id=None,
             bos_token_id=None)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def make_models(folder: Path) -> dict[str, str]:
    import torch
    import transformers

    torch.manual_seed(0)
    v4 = transformers.DeepseekV4Config(
        **WIDTH, moe_intermediate_size=256, q_lora_rank=256, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=128, o_groups=4,
        o_lora_rank=128, index_n_heads=8, index_head_dim=64, index_topk=512, hc_mult=2,
        layer_types=[CSA, HCA, CSA, HCA], mlp_layer_types=["moe"] * 4)
    llama = transformers.LlamaConfig(**WIDTH, num_key_value_heads=8, intermediate_size=1024)
    paths = {}
    for name, cfg, cls in (("DeepSeek V4 (CSA + HCA)", v4, transformers.DeepseekV4ForCausalLM),
                           ("Llama (full attention)", llama, transformers.LlamaForCausalLM)):
        paths[name] = str(folder / name.split()[0])
        cls(cfg).save_pretrained(paths[name])
    return paths


def measure(path: str, contexts: list[int], steps: int = 32) -> list[dict]:
    from tokenmill import LLM, SamplingParams

    top = max(contexts)
    llm = LLM(path, dtype="float32", max_model_len=top + 64, max_num_seqs=1,
              enable_prefix_caching=False, kv_cache_memory=2 * 2**30,
              max_num_batched_tokens=2048)
    engine, rows = llm.engine, []
    for context in contexts:
        ids = [(j * 7 + 3) % 1000 for j in range(context)]
        engine.add_request(None, {"prompt_token_ids": ids},
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0))
        seq = next(iter(engine.requests.values())).seqs[0]
        while seq.num_output_tokens < 2:
            engine.step()  # the prefill, the first token and one decode step (warm)
        held, times = engine.kv_manager.used_bytes, []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        rows.append({"context": context, "step_ms": 1e3 * statistics.median(times),
                     "kv_bytes": held})
    return rows


def plot(results: dict[str, list[dict]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        x = [r["context"] for r in rows]
        left.plot(x, [r["step_ms"] for r in rows], marker="o", label=name)
        right.plot(x, [r["kv_bytes"] / 2**20 for r in rows], marker="o", label=name)
    for ax, label in ((left, "decode step (ms)"), (right, "KV cache held (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("DeepSeek V4 compressed attention vs full attention (same width, float32, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "images" / "v4-decode.png"))
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: measure(path, contexts) for name, path in make_models(Path(tmp)).items()}
    (v4, v4_rows), (llama, llama_rows) = results.items()
    table = [{"context": a["context"], "v4_step_ms": a["step_ms"],
              "llama_step_ms": b["step_ms"], "v4_kv_MiB": a["kv_bytes"] / 2**20,
              "llama_kv_MiB": b["kv_bytes"] / 2**20, "kv_ratio": a["kv_bytes"] / b["kv_bytes"]}
             for a, b in zip(v4_rows, llama_rows)]
    print("one sequence, float32; decode step = median of 32 steps at that context")
    print_table(table, list(table[0]))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    first, last = table[0], table[-1]
    growth = {name: last[f"{key}_step_ms"] / first[f"{key}_step_ms"]
              for name, key in ((v4, "v4"), (llama, "llama"))}
    emit_json({"benchmark": "v4_decode", "machine": machine(), "results": results,
               "step_growth": growth, "kv_ratio_at_max": last["kv_ratio"]})


if __name__ == "__main__":
    main()
