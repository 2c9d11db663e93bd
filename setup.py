"""The build step: compile tokenmill's C++ CPU kernels (tokenmill/kernels/csrc), one shared
library per instruction set of this architecture, into tokenmill/kernels/_lib. They need only a
C++17 compiler, no PyTorch. Without one the install still succeeds (one line says why): the
kernels are then built on first use when a compiler appears, or tokenmill runs its plain
PyTorch ops (decode several times slower)."""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent


def kernel_build():
    """tokenmill/kernels/build.py, loaded on its own (importing tokenmill would need torch)."""
    spec = importlib.util.spec_from_file_location("tokenmill_kernel_build",
                                                  ROOT / "tokenmill" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    def get_ext_filename(self, fullname):  # a plain library for ctypes, not a Python module
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext):
        kb = kernel_build()
        isa = ext.name.rsplit("libtokenmill_", 1)[1]
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            kb.compile_library(isa, out)
        except kb.BuildError as e:
            print(f"tokenmill: the {isa} CPU kernels were not built ({e}); they will be built "
                  "on first use if a compiler is there, else tokenmill runs plain PyTorch ops "
                  "(decode several times slower)", file=sys.stderr)

    def copy_extensions_to_source(self):  # editable installs: skip libraries that failed
        self.extensions = [e for e in self.extensions if os.path.exists(
            os.path.join(self.build_lib, self.get_ext_filename(e.name)))]
        for e in self.extensions:
            Path(self.get_ext_fullpath(e.name)).parent.mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()


kb = kernel_build()
sources = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tokenmill/kernels/csrc").glob("*"))]
setup(
    ext_modules=[Extension(f"tokenmill.kernels._lib.libtokenmill_{isa}", sources=sources)
                 for isa in kb.isas_for()],
    cmdclass={"build_ext": BuildKernels},
)
