"""Build of the one C module, registry/_grouping.c (everything else is in pyproject.toml).

optional=True: where no C compiler is at hand the install still succeeds, and registry/codec.py
falls back to numpy for grouped deltas (same bytes, slower; it writes ungrouped deltas instead).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("registry._grouping", ["registry/_grouping.c"], optional=True, extra_compile_args=["-O3"])])
