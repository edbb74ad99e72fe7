"""Build of the three C modules (everything else is in pyproject.toml): registry/_grouping.c,
registry/_busguard.c and registry/client/_mapfiles.c.

optional=True: where no C compiler is at hand the install still succeeds; registry/codec.py then
falls back to numpy for grouped deltas (same bytes, slower; it writes ungrouped deltas instead),
registry/client/mapping.py maps chunk files one at a time through ctypes, and a file cut short
while it is pushed ends the push with SIGBUS instead of one line (registry/chunking.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("registry._grouping", ["registry/_grouping.c"], optional=True, extra_compile_args=["-O3"]),
    # answers a read past the end of a file cut short while it is pushed (registry/chunking.py)
    Extension("registry._busguard", ["registry/_busguard.c"], optional=True, extra_compile_args=["-O2"]),
    # maps a node's chunk files into tensors in one call (registry/client/mapping.py copes without it)
    Extension("registry.client._mapfiles", ["registry/client/_mapfiles.c"], optional=True, extra_compile_args=["-O3"]),
])
