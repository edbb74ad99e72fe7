"""Run the real `mfsreg` console script in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MFSREG = str(Path(sys.executable).with_name("mfsreg"))


def mfsreg(*args, env: dict, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([MFSREG, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"mfsreg {' '.join(map(str, args))} exited {proc.returncode}: {proc.stderr}")
    return proc


def mfsreg_json(*args, env: dict) -> dict:
    return json.loads(mfsreg(*args, "--json", env=env).stdout)
