"""tokenmill's C++ CPU kernels: one library per instruction set (csrc/, built by build.py),
the best one this CPU runs chosen at start (isa.py), loaded with ctypes (lib.py).

Where a library comes from: the one `pip install` built into this package (kernels/_lib/) when
it was built from the current sources, else one built on first use into
$TOKENMILL_HOME/kernels/<source hash>/ (a few seconds). Without a compiler the engine runs its
plain PyTorch reference ops. Overrides: TOKENMILL_KERNELS=0 (reference ops only),
TOKENMILL_ISA=amx|avx512_bf16|avx512|avx2|neon|scalar (force one build; scalar is the portable one).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from tokenmill.kernels.build import BuildError, compile_library, library_name, source_hash
from tokenmill.kernels.isa import DESCRIPTIONS, describe_cpu, supported_isas
from tokenmill.kernels.lib import KernelLib

logger = logging.getLogger("tokenmill")

PACKAGED = Path(__file__).parent / "_lib"


def home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill"))


def cache_dir() -> Path:
    return home() / "kernels" / source_hash()


def chosen_isa() -> str:
    """TOKENMILL_ISA when set (it must be one this CPU runs), else the best this CPU runs."""
    isas = supported_isas()
    forced = os.environ.get("TOKENMILL_ISA")
    if forced:
        if forced not in isas:
            raise ValueError(f"TOKENMILL_ISA={forced!r}: this CPU runs {', '.join(isas)}")
        return forced
    return isas[0]


def load_cpu_kernels(isa: str | None = None) -> KernelLib | None:
    """The kernel library for `isa` (default: chosen_isa()), or None with the reason logged."""
    if os.environ.get("TOKENMILL_KERNELS", "1") == "0":
        return None
    return _load(isa or chosen_isa())


@functools.cache
def _load(isa: str) -> KernelLib | None:
    if isa not in supported_isas():
        raise ValueError(f"this CPU cannot run the {isa!r} kernels; it runs "
                         f"{', '.join(supported_isas())}")
    try:
        lib = KernelLib(library_path(isa))
    except (BuildError, OSError, ValueError) as e:
        logger.warning("CPU kernels unavailable (%s); running PyTorch reference ops (decode "
                       "several times slower)", str(e).splitlines()[0])
        return None
    logger.info("CPU kernels: %s (%s) on %s", isa, DESCRIPTIONS[isa], describe_cpu())
    return lib


def library_path(isa: str) -> Path:
    """The packaged library when it matches the sources, else the cached one (built if needed)."""
    name = library_name(isa)
    for path in (PACKAGED / name, cache_dir() / name):
        if path.exists() and _built_from_current_sources(path):
            return path
    logger.info("building the %s CPU kernels into %s", isa, cache_dir())
    return compile_library(isa, cache_dir() / name)


def _built_from_current_sources(path: Path) -> bool:
    try:
        return KernelLib(path).source_hash == source_hash()
    except (OSError, ValueError, AttributeError):  # AttributeError: an older library's symbols
        return False
