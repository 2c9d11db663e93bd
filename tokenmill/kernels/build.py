"""Compiling the C++ kernels (csrc/): one shared library per instruction set, each from the same
sources with its own compiler flags, loaded with ctypes (kernels/lib.py). They need no PyTorch
headers, only a C++17 compiler (and OpenMP for threads): `pip install` builds them (setup.py),
and a source tree that changed since is rebuilt on first use into $TOKENMILL_HOME/kernels."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"

# Best first. The x86 flags name exactly the extensions each vector layer uses (vec_*.h).
ISA_FLAGS = {
    # the AVX512-BF16 build plus AMX tiles: bf16 for the GEMM and prefill attention
    # (gemm_amx.h, attention_amx.h), int8 for the quantized GEMM's many-row calls (quant_amx.h)
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
            "-mavx512vnni", "-mavx2", "-mfma", "-mf16c", "-mamx-tile", "-mamx-bf16",
            "-mamx-int8", "-DTM_ISA_AVX512_BF16"],
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                    "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": [],  # Advanced SIMD is part of every AArch64 CPU
    "scalar": [],  # plain C++: the portable build
}
ARCH_ISAS = {"x86_64": ("amx", "avx512_bf16", "avx512", "avx2", "scalar"),
             "aarch64": ("neon", "scalar")}
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-math-errno",
              "-ffp-contract=off"]  # no silent FMA contraction: roundings match the references


class BuildError(RuntimeError):
    """The compiler is missing or failed; the message is one line."""


def machine_arch(machine: str | None = None) -> str:
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def isas_for(arch: str | None = None) -> tuple[str, ...]:
    """The instruction sets a build for this architecture compiles (scalar everywhere)."""
    return ARCH_ISAS.get(machine_arch(arch), ("scalar",))


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def source_hash() -> str:
    """Identifies the kernel sources: a library built from other sources is not used."""
    h = hashlib.sha256()
    for p in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def library_name(isa: str) -> str:
    return f"libtokenmill_{isa}.so"


def compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


def compile_library(isa: str, out: Path, cxx: str | None = None) -> Path:
    """Build csrc/ for `isa` into `out` (written atomically); without OpenMP when the compiler
    has none (single-threaded kernels)."""
    cxx = cxx or compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    try:
        return _compile(isa, out, cxx, ["-fopenmp"])
    except BuildError as with_openmp:
        try:
            return _compile(isa, out, cxx, [])
        except BuildError:
            raise with_openmp from None


def _compile(isa: str, out: Path, cxx: str, extra: list[str]) -> Path:
    flags = [*BASE_FLAGS, f"-DTM_ISA_{isa.upper()}", f'-DTM_SOURCE_HASH="{source_hash()}"',
             *ISA_FLAGS[isa], *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in sources()]
        jobs = [[cxx, *flags, "-c", str(src), "-o", str(obj)]
                for src, obj in zip(sources(), objects)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            errors = [e for e in pool.map(_run, jobs) if e]
        errors = errors or [e for e in [_run([cxx, *flags, *map(str, objects), "-o",
                                              str(Path(tmp) / out.name)])] if e]
        if errors:
            raise BuildError(f"{isa}: {errors[0]}")
        os.replace(Path(tmp) / out.name, out)
    return out


def _run(cmd: list[str]) -> str:
    """'' on success, else the compiler's first error line."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return ""
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()
    return (lines[0] if lines else f"{cmd[0]} exited with {proc.returncode}")[:300]
