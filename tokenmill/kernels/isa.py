"""Which of the kernel builds this CPU can run, from its features as PyTorch's cpuinfo reads
them (cpuid on x86, which also checks that the OS saves the wide registers), never from
parsing /proc/cpuinfo."""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from tokenmill.kernels.build import isas_for, machine_arch

# The x86 extensions each build's flags enable (build.ISA_FLAGS), as cpuinfo names them.
NEEDS = {
    "amx": ("amx_tile", "amx_bf16", "amx_int8", "avx512_f", "avx512_bw", "avx512_vl", "avx512_dq",
            "avx512_bf16", "avx512_vnni", "avx2", "fma3", "f16c"),
    "avx512_bf16": ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16",
                    "avx512_vnni", "avx2", "fma3", "f16c"),
    "avx512": ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx2", "fma3", "f16c"),
    "avx2": ("avx2", "fma3", "f16c"),
}
DESCRIPTIONS = {
    "amx": "AVX512-BF16 with AMX bf16 and int8 tiles for the GEMMs",
    "avx512_bf16": "AVX-512 with BF16 and VNNI dot products",
    "avx512": "AVX-512",
    "avx2": "AVX2 + FMA",
    "neon": "NEON",
    "scalar": "portable C++, no vector instructions of its own",
}


@functools.lru_cache(maxsize=1)
def cpu_features() -> dict:
    """cpuinfo's feature flags (plus cpu_name and core counts), {} where PyTorch cannot say."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except Exception:  # a PyTorch without this private helper: only the public summary
        level = torch.backends.cpu.get_cpu_capability()
        flags = {"AVX512": NEEDS["avx512"], "AVX2": NEEDS["avx2"]}.get(level, ())
        return {flag: True for flag in flags}


def supported_isas() -> list[str]:
    """The builds this CPU can run, best first; scalar always."""
    feats = cpu_features()
    return [isa for isa in isas_for() if all(feats.get(f) for f in NEEDS.get(isa, ()))
            and (isa != "amx" or os_allows_amx())]


@functools.lru_cache(maxsize=1)
def os_allows_amx() -> bool:
    """Linux gives a process AMX tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM
    for XTILEDATA, once per process; PyTorch's oneDNN asks the same); False where it refuses."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0
    except (OSError, AttributeError):
        return False


def describe_cpu() -> str:
    """One line: the CPU and the features that matter to the kernels (for logs and benchmarks)."""
    feats = cpu_features()
    names = ["avx2", "avx512_f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"]
    have = [n for n in names if feats.get(n)]
    name = feats.get("cpu_name") or machine_arch()
    return f"{name} ({machine_arch()}; {' '.join(have) or 'no x86 vector extensions'})"
