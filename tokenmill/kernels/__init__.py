"""Optional C++ CPU kernels (AVX2/FMA), compiled on first use with torch's JIT extension
builder and cached under $TOKENMILL_HOME/kernels. When they cannot be built (no compiler, not
x86-64 with AVX2) tokenmill runs its plain PyTorch reference paths instead."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger("tokenmill")

_DIR = Path(__file__).parent
SOURCES = [_DIR / name for name in ("cpu_ops.cpp", "gemm.cpp", "elementwise.cpp", "attention.cpp")]
HEADER = _DIR / "cpu_ops.h"


def _cpu_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def cache_dir() -> Path:
    home = Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [HEADER, *SOURCES])).hexdigest()[:12]
    return home / "kernels" / digest


@functools.lru_cache(maxsize=1)
def load_cpu_kernels():
    """The compiled module, or None (with the reason logged) when it is unavailable."""
    if os.environ.get("TOKENMILL_KERNELS", "1") == "0":
        return None
    if not _cpu_has_avx2():
        logger.info("CPU kernels need x86-64 with AVX2 and FMA; using PyTorch reference paths")
        return None
    try:
        from torch.utils.cpp_extension import load

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        return load(
            name="tokenmill_cpu_ops",
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: the reference paths still work
        logger.warning("CPU kernels unavailable (%s); using PyTorch reference paths",
                       str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
