"""`make demo`: build a small synthetic family, push it to the embedded registry, print the sharing
figures, pull one member back and show that it is byte-identical; then (in the demo's own registry)
delete a member, prune, and pull again.

Everything runs through the real `mfsreg` command, as a user would type it. The registry lives in
.demo/home (SQLite + a local pack directory: the embedded default's backends) so the demo never
touches your own ~/.mfsreg; set MFSREG_HOME to use another place.
"""

from __future__ import annotations

import filecmp
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.family import generate  # noqa: E402

DEMO = ROOT / ".demo"
MFSREG = str(Path(sys.executable).with_name("mfsreg"))


def run(*args: str, capture: bool = False) -> str:
    print(f"\n$ mfsreg {' '.join(shlex.quote(str(a)) for a in args)}", flush=True)
    proc = subprocess.run([MFSREG, *map(str, args)], check=True, text=True, capture_output=capture)
    return proc.stdout if capture else ""


def main() -> None:
    home = Path(os.environ.get("MFSREG_HOME") or DEMO / "home").absolute()
    if home == DEMO / "home" and home.exists():
        shutil.rmtree(home)  # start from an empty registry every time
    os.environ["MFSREG_HOME"] = str(home)
    os.environ.pop("MFSREG_URL", None)
    print(f"building a synthetic family (bf16, LLM-shaped) in {DEMO / 'family'} ...", flush=True)
    members = generate(DEMO / "family", scale=0.02)
    parents = {
        "lora-chat": "base",
        "lastlayers-code": "base",
        "full-medical": "base",
        "vocab-ext": "base",
        "lora-chat-v2": "lora-chat",
    }
    for name, path in members.items():
        args = ["push", path, "--family", "demo-llm", "--version", name]
        if name in parents:
            args += ["--parent", parents[name]]
        res = json.loads(run(*args, "--json", capture=True))
        print(
            f"  {name:16s} {res['logical_bytes'] / 1e6:8.1f} MB logical, {res['new_bytes'] / 1e6:8.1f} MB new, "
            f"{res['reused_chunks']}/{res['chunks']} chunks reused"
        )
    run("ls", "demo-llm")
    run("stats", "--family", "demo-llm")
    out = DEMO / "pulled" / "vocab-ext.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    run("pull", "demo-llm", "vocab-ext", "-o", out)
    same = filecmp.cmp(out, members["vocab-ext"], shallow=False)
    print(f"\npulled file is byte-identical to the pushed one: {same}")
    if not same:
        raise SystemExit(1)
    if home != DEMO / "home":
        point_here(home)
        return  # prune acts on a whole registry: only on the demo's own
    # deleting a version drops its references; prune gives back the space its own chunks took
    run("delete", "demo-llm", "lastlayers-code")
    run("prune", "--min-age", "0")  # nothing else uses this registry: no grace period needed
    run("pull", "demo-llm", "vocab-ext", "-o", out)
    if not filecmp.cmp(out, members["vocab-ext"], shallow=False):
        raise SystemExit("vocab-ext changed after the prune")
    print("\nafter the prune, vocab-ext still pulls byte-identical")
    point_here(home)


def point_here(home: Path) -> None:
    """The line that points the user's own shell at the demo's registry."""
    print(
        f"\nthe demo's registry is in {home}; to look at it with the CLI:\n\n    export MFSREG_HOME={shlex.quote(str(home))}"
    )


if __name__ == "__main__":
    main()
