"""Choosing kernels: the instruction set from the CPU's features (and TOKENMILL_ISA), the
portable build, libraries built from other sources never loaded, build errors in one line,
and the GEMM plan (packed kernel vs PyTorch's matmul, fused decode batch sizes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels import build, gemm_plan, isa
from tokenmill.kernels.gemm_plan import NEVER, GemmTimes, PreparedLinear, fused_max_rows
from tokenmill.layers import ops
from tokenmill.layers.kernel_ops import KernelOps

needs_compiler = pytest.mark.skipif(
    build.compiler() is None or os.environ.get("TOKENMILL_KERNELS") == "0",
    reason="no C++ compiler here, or TOKENMILL_KERNELS=0")


def test_isa_choice_follows_features_and_override(monkeypatch):
    monkeypatch.delenv("TOKENMILL_ISA", raising=False)
    monkeypatch.setattr(isa, "cpu_features", lambda: {"avx2": True, "fma3": True, "f16c": True})
    monkeypatch.setattr(isa, "isas_for", lambda arch=None: build.ARCH_ISAS["x86_64"])
    assert isa.supported_isas() == ["avx2", "scalar"]
    monkeypatch.setattr(kernels, "supported_isas", isa.supported_isas)
    assert kernels.chosen_isa() == "avx2"
    monkeypatch.setenv("TOKENMILL_ISA", "scalar")
    assert kernels.chosen_isa() == "scalar"
    monkeypatch.setenv("TOKENMILL_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="this CPU runs avx2, scalar"):
        kernels.chosen_isa()
    monkeypatch.setattr(isa, "cpu_features", lambda: {})  # no AVX2: the portable build only
    assert isa.supported_isas() == ["scalar"]


def test_amx_needs_the_cpu_features_and_the_os(monkeypatch):
    """The AMX build runs only where the CPU has the tiles and Linux grants the process their
    state (arch_prctl); otherwise the AVX512-BF16 build is the best."""
    feats = {f: True for f in isa.NEEDS["amx"]}
    monkeypatch.setattr(isa, "cpu_features", lambda: feats)
    monkeypatch.setattr(isa, "isas_for", lambda arch=None: build.ARCH_ISAS["x86_64"])
    monkeypatch.setattr(isa, "os_allows_amx", lambda: True)
    assert isa.supported_isas()[:2] == ["amx", "avx512_bf16"]
    monkeypatch.setattr(isa, "os_allows_amx", lambda: False)
    assert isa.supported_isas()[0] == "avx512_bf16"
    monkeypatch.setattr(isa, "os_allows_amx", lambda: True)
    feats["amx_bf16"] = False
    assert isa.supported_isas()[0] == "avx512_bf16"
    feats["amx_bf16"], feats["amx_int8"] = True, False  # the quantized GEMM's tiles
    assert isa.supported_isas()[0] == "avx512_bf16"


def test_arm_runs_neon_then_scalar(monkeypatch):
    monkeypatch.setattr(isa, "isas_for", lambda arch=None: build.isas_for("arm64"))
    assert isa.supported_isas() == ["neon", "scalar"]


def test_kernels_off(monkeypatch):
    monkeypatch.setenv("TOKENMILL_KERNELS", "0")
    assert kernels.load_cpu_kernels() is None
    assert isinstance(ops.select(True, torch.device("cpu")), ops.TorchOps)
    assert not isinstance(ops.select(True, torch.device("cpu")), KernelOps)


@needs_compiler
@pytest.mark.skipif(shutil.which("objdump") is None or build.machine_arch() != "x86_64",
                    reason="needs objdump on x86-64")
def test_portable_build_has_no_vector_extensions():
    """The scalar library: no AVX/AVX2/AVX-512 instruction (no ymm/zmm register anywhere in its
    code) and no intrinsics header in its vector layer."""
    lib = kernels.load_cpu_kernels("scalar")
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib.path)],
                         capture_output=True, text=True, check=True).stdout
    assert "%ymm" not in asm and "%zmm" not in asm
    assert "tm_linear_fwd" in asm  # the disassembly is real
    avx2 = subprocess.run(["objdump", "-d", str(kernels.load_cpu_kernels("avx2").path)],
                          capture_output=True, text=True, check=True).stdout
    assert "%ymm" in avx2  # and the check can fail
    assert "intrin.h" not in (build.CSRC / "vec_scalar.h").read_text()


@needs_compiler
def test_library_from_other_sources_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    current = build.source_hash()
    path = kernels.library_path("scalar")
    assert kernels.KernelLib(path).source_hash == current
    monkeypatch.setattr(build, "source_hash", lambda: "0123456789abcdef")
    monkeypatch.setattr(kernels, "source_hash", build.source_hash)
    rebuilt = kernels.library_path("scalar")  # neither the packaged nor the cached one fits
    assert rebuilt != path and kernels.KernelLib(rebuilt).source_hash == "0123456789abcdef"


def test_build_error_is_one_line(tmp_path):
    with pytest.raises(build.BuildError) as e:
        build.compile_library("scalar", tmp_path / "lib.so", cxx="false")
    assert "\n" not in str(e.value) and "scalar" in str(e.value)


def times(packed, torch_):
    return GemmTimes([1, 4, 16, 64], packed, torch_)


def test_torch_from_rows():
    assert times([1, 2, 3, 4], [9, 9, 9, 9]).torch_from_rows() == NEVER
    assert times([1, 2, 3, 4], [9, 9, 1, 1]).torch_from_rows() == 16
    assert times([1, 2, 3, 4], [0.5, 9, 1, 1]).torch_from_rows() == 16  # only from 16 on
    assert times([1, 2, 3, 4], [0.5, 1, 1, 1]).torch_from_rows() == 1
    assert times([1, 2, 3, 4], [1, 2, 3, 3.9]).torch_from_rows() == NEVER  # within the margin
    assert times([1, 2, 3, 4], [9, 9, 2.5, 3]).torch_from_rows(1.25) == 64


def test_fused_max_rows(monkeypatch):
    monkeypatch.delenv("TOKENMILL_GEMM", raising=False)
    ms = 1e-3

    def layer(packed, torch_):
        return [PreparedLinear(None, 0, times(packed, torch_))] * 4

    # PyTorch's matmul a little faster at 16 rows: not enough to pay for leaving the fused step
    slightly = layer([ms, 2 * ms, 4 * ms, 8 * ms], [9, 9, 3.9 * ms, 4 * ms])
    assert fused_max_rows([slightly] * 30) == 32  # wins at 16, loses at 64: the middle
    much = layer([ms, 2 * ms, 4 * ms, 8 * ms], [9, ms, ms, ms])
    assert fused_max_rows([much] * 30) == 2
    never = layer([ms] * 4, [9] * 4)
    assert fused_max_rows([never] * 30) == NEVER
    monkeypatch.setenv("TOKENMILL_GEMM", "torch")
    assert fused_max_rows([never] * 30) == 0
    monkeypatch.setenv("TOKENMILL_GEMM", "packed")
    assert fused_max_rows([much] * 30) == NEVER
    monkeypatch.setenv("TOKENMILL_GEMM", "fastest")
    with pytest.raises(ValueError, match="TOKENMILL_GEMM"):
        fused_max_rows([much])


@needs_compiler
def test_plan_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_GEMM", raising=False)
    lib = kernels.load_cpu_kernels()
    calls = []
    fake = times([1, 2, 3, 4], [9, 9, 1, 1])
    monkeypatch.setattr(gemm_plan, "measure", lambda *a: calls.append(1) or fake)
    w = torch.randn(40, 24)
    planner = gemm_plan.GemmPlanner(lib, tmp_path / "plan.json")
    assert planner.prepare(w, None).torch_from_rows == 16
    assert planner.prepare(w, None).torch_from_rows == 16 and len(calls) == 1
    again = gemm_plan.GemmPlanner(lib, tmp_path / "plan.json")  # a later process
    assert again.prepare(w, None).torch_from_rows == 16 and len(calls) == 1


@needs_compiler
def test_bf16_on_amx_keeps_its_kernel_unless_much_slower(monkeypatch, tmp_path):
    """On AMX a bf16 row's bits do not depend on the call's row count (gemm_amx.h), and
    PyTorch's would: it takes a bf16 GEMM over there only where 1.25x faster (elsewhere, and
    for float32, 1.05x)."""
    monkeypatch.delenv("TOKENMILL_GEMM", raising=False)
    lib = kernels.load_cpu_kernels()
    monkeypatch.setattr(gemm_plan, "measure", lambda *a: times([1, 2, 3, 4], [9, 9, 2.5, 3]))
    planner = gemm_plan.GemmPlanner(lib, tmp_path / "plan.json")
    w = torch.randn(40, 24)
    assert planner.prepare(w, None).torch_from_rows == 16
    bf16 = planner.prepare(w.bfloat16(), None).torch_from_rows
    assert bf16 == (64 if lib.bf16_rows_invariant else 16)


@needs_compiler
def test_linear_dispatch_follows_the_plan(monkeypatch):
    """Below the plan's row count the packed kernel runs, from it PyTorch's matmul; logits
    (out_fp32) always come from the packed kernel."""
    from tokenmill.layers.linear import Linear

    lib = kernels.load_cpu_kernels()
    backend = KernelOps(lib)
    monkeypatch.setattr(backend.planner, "prepare",
                        lambda w, b, gated=False: PreparedLinear(lib.pack(w, b), 8, None))
    with ops.building(backend):
        layer = Linear(24, [40])
    layer.weight.data = torch.randn(40, 24)
    ran = []
    real = lib.linear
    monkeypatch.setattr(lib, "linear", lambda *a, **k: ran.append(a[0].shape[0]) or real(*a, **k))
    for rows in (1, 7, 8, 30):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))
    layer(torch.randn(30, 24), out_fp32=True)
    assert ran == [1, 7, 30]


@needs_compiler
def test_prefill_attention_measure_runs():
    """The start-up measurement behind the prefill attention plan: both paths timed at each
    length of the ladder."""
    from tokenmill.kernels import attention_plan

    times = attention_plan.measure(kernels.load_cpu_kernels(), 4, 2, 32, torch.bfloat16)
    assert times.rows == list(attention_plan.LENGTHS[: len(times.rows)]) and times.rows
    assert all(t > 0 for t in times.packed + times.torch)


def test_kernel_types_have_one_definition():
    """A type named alike in two source files of one library breaks the one-definition rule:
    the linker keeps one of their (inline) destructors for both, and thread-local scratch of
    the other layout was freed with it at exit (a segfault after a bf16 prefill + decode)."""
    import re

    seen: dict[str, str] = {}
    for path in sorted(build.CSRC.iterdir()):
        if path.suffix not in (".cpp", ".h") or path.name.startswith("vec_"):
            continue  # vec_*.h: one instruction set's vector layer per build
        for name in re.findall(r"^(?:struct|class) (\w+)\s*[:{]", path.read_text(), re.M):
            assert name not in seen, f"{name} is defined in {seen[name]} and {path.name}"
            seen[name] = path.name
    assert {"PrefillScratch", "Scratch"} <= seen.keys()


@needs_compiler
def test_bf16_prefill_and_decode_exit_cleanly(tiny_llama):
    """A process that ran the prefill kernel and the fused decode step on bf16 exits with 0."""
    code = ("import sys; from tokenmill import LLM, SamplingParams; "
            "llm = LLM(sys.argv[1], dtype='bfloat16', max_model_len=256); "
            "llm.generate({'prompt_token_ids': list(range(3, 90))}, "
            "SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_llama[0])], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
