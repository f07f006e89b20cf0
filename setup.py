"""The wheel carries ctropt's kernel library prebuilt (ctropt/kernels/compiling.py: one build per instruction set and
the library that picks one at load time), so installing it needs no compiler; a source install without gcc still
installs and builds the library on first use when a compiler appears. Everything else is in pyproject.toml."""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildPyWithKernels(build_py):
    """build_py, then the kernel library compiled into the build's ctropt/kernels (not for editable installs:
    a checkout builds it beside the sources on first use)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("CTROPT_NO_PREBUILT_KERNELS"):
            return
        spec = importlib.util.spec_from_file_location("ctropt_kernels_compiling",
                                                      Path(__file__).parent / "ctropt/kernels/compiling.py")
        compiling = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compiling)
        out = Path(self.build_lib) / "ctropt/kernels/libctropt_kernels.so"
        try:
            compiling.build(out, compiler=os.environ.get("CC") or "gcc")
        except compiling.BuildError as e:   # no compiler: a wheel without the library, built on first use instead
            print(f"ctropt: kernel library not prebuilt ({str(e).splitlines()[0]})", file=sys.stderr)


class BinaryDistribution(Distribution):
    """A wheel for one platform (it holds compiled libraries), not a pure-Python one."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Tagged py3-none-<platform>: the libraries do not depend on the Python version."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
