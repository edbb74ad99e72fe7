"""``python -m mfsreg``: the same command as the ``mfsreg`` console script."""

from mfsreg.cli.main import entry

entry()
