"""CLI start-up: wall time of `mfsreg --help`, `--version`, `ls`, `show` and `stats` on the embedded
default, beside `python -c pass` in the same run.

Method. A fresh MFSREG_HOME gets a family of 8 versions (1 MiB each, sharing a base). Each command
then runs ``--runs`` times as a new process of the installed console script, the commands taken in
turn within a round so that a slow spell of the machine falls on all of them; one untimed round
first. The figure is the median wall time. ``imports`` splits one `mfsreg ls` by what it loads
(``python -X importtime``, cumulative microseconds of each top-level package). Gate (issue 37):
every command at or under 0.3 s.

    python -m benchmarks.cli_startup [--runs 9]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import finish, machine_info, median, table

GATE_SECONDS = 0.3
MFSREG = str(Path(sys.executable).with_name("mfsreg"))
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "mfsreg --help": [MFSREG, "--help"],
    "mfsreg --version": [MFSREG, "--version"],
    "mfsreg ls": [MFSREG, "ls"],
    "mfsreg ls fam": [MFSREG, "ls", "fam"],
    "mfsreg show fam v1": [MFSREG, "show", "fam", "v1"],
    "mfsreg stats": [MFSREG, "stats"],
}
GATED = [name for name in COMMANDS if name.startswith("mfsreg")]


def make_family(home: Path) -> None:
    """Eight versions of one family in the embedded registry at ``home``: a base and seven members
    that each change one of its four tensors."""
    import numpy as np
    from safetensors.numpy import save_file

    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    rng = np.random.default_rng(0)
    base = {f"layer{i}.weight": rng.standard_normal((256, 256), dtype=np.float32) for i in range(4)}
    with Registry(Settings.from_env({"MFSREG_HOME": str(home)})) as reg:
        for v in range(8):
            tensors = dict(base)
            if v:
                name = f"layer{v % 4}.weight"
                tensors[name] = tensors[name] + np.float32(v * 1e-3)
            path = home / f"v{v}.safetensors"
            save_file(tensors, str(path))
            reg.push(path, "fam", f"v{v}", parent="v0" if v else None)
            path.unlink()


def run_once(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return wall


def import_split(env: dict) -> dict[str, int]:
    """Import microseconds of each top-level package one `mfsreg ls` loads (the self time of all
    its modules), largest first."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from mfsreg.cli.main import main; main(['ls'])"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    top: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        self_us = parts[0].removeprefix("import time:").strip()
        if len(parts) == 3 and self_us.isdigit():
            name = parts[2].strip().split(".")[0]
            top[name] = top.get(name, 0) + int(self_us)
    return dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])


def report(doc: dict) -> str:
    rows = [
        [
            name,
            r["median_s"],
            r["min_s"],
            r["max_s"],
            "" if name not in GATED else ("met" if r["median_s"] <= GATE_SECONDS else "NOT met"),
        ]
        for name, r in doc["commands"].items()
    ]
    lines = [
        f"CLI start-up, median of {doc['runs']} runs (gate: each mfsreg command <= {GATE_SECONDS} s)",
        "",
        table(["command", "median s", "min s", "max s", "gate"], rows),
        "",
        "`mfsreg ls` imports (ms, by package): "
        + ", ".join(f"{k} {v / 1000:.0f}" for k, v in doc["imports_ls_us"].items()),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs of each command (default 9)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mfsreg-cli-") as tmp:
        home = Path(tmp) / "home"
        make_family(home)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
        env.update(MFSREG_HOME=str(home), COLUMNS="120")
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for round_ in range(args.runs + 1):
            for name, cmd in COMMANDS.items():
                wall = run_once(cmd, env)
                if round_:  # the first round warms the page cache and the bytecode caches
                    times[name].append(wall)
        imports = import_split(env)
    doc = {
        "benchmark": "cli_startup",
        "runs": args.runs,
        "gate_seconds": GATE_SECONDS,
        "commands": {
            name: {
                "median_s": round(median(ts), 4),
                "min_s": round(min(ts), 4),
                "max_s": round(max(ts), 4),
                "runs_s": [round(t, 4) for t in ts],
            }
            for name, ts in times.items()
        },
        "gate_met": all(median(times[name]) <= GATE_SECONDS for name in GATED),
        "imports_ls_us": imports,
        "machine": machine_info(),
    }
    finish("cli_startup.json", doc, report, t_start)


if __name__ == "__main__":
    main()
