"""Engine configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.layers.kv_quant import KV_FORMATS
from tokenmill.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4", "int4-g128")  # quantization/rtn.py
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)


def _positive(name: str, value: int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for. Values left as None are resolved by the engine from the model.

    kv_cache_memory: bytes for the paged KV cache. When None, the cache holds
    max_num_seqs x max_model_len tokens, capped at a fraction of free memory.
    quantization: quantize a float checkpoint's linear layers at load (QUANTIZATIONS); None
    keeps what the checkpoint has (a quantized GGUF, AWQ or GPTQ model stays quantized).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # tokens per KV block; None: the KV format's (16; int4 32)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    use_kernels: bool = True  # C++ CPU kernels when they build; False = PyTorch reference ops
    # batch-invariant kernels (layers/batch_invariant.py): results independent of batching,
    # chunking, prefix caching and prefill vs decode
    deterministic: bool = False
    # speculative decoding, as vLLM's: {"method": "ngram", "num_speculative_tokens": 4, ...},
    # {"model": PATH, "num_speculative_tokens": 4}, a JSON string of either, or None
    speculative_config: SpeculativeConfig | dict | str | None = None
    # tensor parallelism over torch.distributed (distributed/): ranks, and for several nodes
    # the rendezvous (master_port None: a free port, on one node only)
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout: float = 120.0  # seconds a rendezvous or collective may wait

    @property
    def parallel(self):
        """The ParallelConfig of these fields (distributed/group.py)."""
        from tokenmill.distributed.group import ParallelConfig

        port = self.master_port
        if port is None:
            import socket

            with socket.socket() as s:  # one node: any free loopback port
                s.bind((self.master_addr, 0))
                port = s.getsockname()[1]
        return ParallelConfig(self.tensor_parallel_size, self.nnodes, self.node_rank,
                              self.master_addr, port, self.distributed_timeout)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path or name, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_seqs", self.max_num_seqs, allow_none=False)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory", self.kv_cache_memory)
        _positive("num_threads", self.num_threads)
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need a master_port every node can reach")
        from tokenmill.distributed.group import ParallelConfig

        ParallelConfig(self.tensor_parallel_size, self.nnodes, self.node_rank,
                       self.master_addr, self.master_port or 1)  # raises on bad values
        if self.block_size is not None and self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        if self.deterministic and self.kv_cache_dtype in ("float32", "bfloat16", "float16"):
            raise ValueError("deterministic mode keeps the KV cache in the model's dtype "
                             f"(kv_cache_dtype 'auto') or quantizes it (int8, fp8_e4m3, int4), "
                             f"got {self.kv_cache_dtype!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens is not None and (
            self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
