"""Builds macroflow's compiled modules where it can; pyproject.toml says the rest.

The compiled modules (``macroflow.transport._cring``, the rings' common
steps in C) are optional: each has a pure-Python twin that runs where no C
compiler or Cython is at hand, so a failed build warns and the install goes
on. ``MACROFLOW_BUILD_COMPILED=0`` skips them.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

MODULES = [("macroflow.transport._cring", "src/macroflow/transport/_cring.pyx")]


class optional_build_ext(build_ext):
    """build_ext that warns, not fails, when a compiled module cannot be built."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # no compiler at all: distutils' errors derive from Exception
            _warn(f"compiled modules not built ({e}); macroflow runs its pure-Python code")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            _warn(f"{ext.name} not built ({e}); macroflow runs its pure-Python code")


def _warn(text):
    print(f"WARNING: {text}", file=sys.stderr)


def _extensions():
    if os.environ.get("MACROFLOW_BUILD_COMPILED", "1") == "0":
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        _warn("Cython is not installed: compiled modules not built")
        return []
    exts = [Extension(name, [src], extra_compile_args=["-O2"]) for name, src in MODULES]
    try:
        return cythonize(exts, quiet=True, language_level=3)
    except Exception as e:
        _warn(f"Cython failed ({e}): compiled modules not built")
        return []


if __name__ == "__main__":  # (as setuptools runs it; tests load it under another name)
    setup(ext_modules=_extensions(), cmdclass={"build_ext": optional_build_ext})
