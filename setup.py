"""Packages and C modules (metadata is in pyproject.toml).

The folders registry/, api/, cli/ and migrations/ stay at the top of the repository and install under
one import name, ``mfsreg``: ``mfsreg.registry``, ``mfsreg.api``, ``mfsreg.cli``, ``mfsreg.migrations``
(tests/test_packaging.py builds the wheel and reads its top-level names).

The three C modules are optional: without a C compiler the install still succeeds; registry/format/codec.py
then writes ungrouped deltas (numpy), registry/client/mapping.py maps chunk files through ctypes one
at a time, and a file cut short while it is pushed ends the push with SIGBUS instead of one line.
"""

from setuptools import Extension, find_packages, setup

ROOTS = {
    "mfsreg": "mfsreg",
    "mfsreg.registry": "registry",
    "mfsreg.api": "api",
    "mfsreg.cli": "cli",
    "mfsreg.migrations": "migrations",
}
PACKAGES = [sub for name, folder in ROOTS.items() for sub in [name, *(f"{name}.{p}" for p in find_packages(folder))]]


def ext(name: str, source: str, opt: str) -> Extension:
    return Extension(name, [source], optional=True, extra_compile_args=[opt])


setup(
    packages=PACKAGES,
    package_dir=ROOTS,
    package_data={"mfsreg.migrations": ["*.ini", "*.mako"], "mfsreg.api.web": ["templates/*.html", "assets/*"]},
    ext_modules=[
        ext("mfsreg.registry.format._grouping", "registry/format/_grouping.c", "-O3"),  # grouped deltas
        ext(
            "mfsreg.registry.format._busguard", "registry/format/_busguard.c", "-O2"
        ),  # a pushed file cut short: one line
        ext("mfsreg.registry.client._mapfiles", "registry/client/_mapfiles.c", "-O3"),  # chunk files mapped in one call
    ],
)
