"""The CPU cost of one push under two revisions of the code, measured as interleaved pairs.

    python -m benchmarks.compare_ingest REV [--against REV2] [--member full-medical|base|...] [--pairs 3]
        [--through embedded|server] [--op push|pull]

This VM's speed swings by up to 1.5x between hours, so two benchmark runs made at different times
cannot show a 10% change. Here the two versions of the code push the same member one after the
other, pair after pair, and each pair gives a ratio.

Method. REV (and REV2, default: the working tree) is checked out with ``git worktree`` under
DATA/compare/ and its C module built in place with this interpreter (the working tree's too); each
child reports which checkout and which C module it imported, and the run stops if either is not
the side's own. For each side, an embedded
registry holding the member's parent (the base; nothing, for the base itself) is made once as a template. Each push then runs
in a fresh process on a copy of that template: the process first pushes a small two-version
family (imports, thread pools and scratch buffers warm up, as in a long-lived server), then
pushes the member, timing user + system CPU of the whole process around that push alone. With
``--through server`` the process also runs the side's API app (uvicorn in a thread, over the same
embedded registry) and every push goes through the side's remote client: the CPU then counts the
client and the server, as bench_api's pushes do. With ``--op pull`` the template holds the member
too, and the timed step is its pull: rebuilt from the store (embedded), or fetched through the
server into an empty node cache and assembled (server). The
sides take turns going first. The files are read into the page cache first. Prints the CPU-seconds of each side, pair by pair, and
their ratio; writes benchmarks/results/compare_ingest.json (or --out; earlier runs live in git history).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks import anchors
from benchmarks.common import MB, REPO, finish, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, generate

# Imports the side's checkout (sys.argv[1]) as ``core`` (its registry/ package) and ``side(name)``
# (one of its modules), whatever its layout: revisions before the mfsreg namespace have a top-level
# ``registry`` package; later ones map registry/ to ``mfsreg.registry``.
SIDE_IMPORT = r"""
import importlib, os, sys
sys.path.insert(0, sys.argv[1])
if os.path.isdir(os.path.join(sys.argv[1], "mfsreg")):
    import mfsreg
    mfsreg.__path__.append(sys.argv[1])
    _PKG = "mfsreg.registry"
else:
    _PKG = "registry"
core = importlib.import_module(_PKG)
_FORMAT = os.path.isdir(os.path.join(sys.argv[1], "registry", "format"))  # the format's modules moved there in 0.2.0
def side(name):
    if _FORMAT and os.path.exists(os.path.join(sys.argv[1], "registry", "format", name + ".py")):
        return importlib.import_module(f"{_PKG}.format.{name}")
    return importlib.import_module(f"{_PKG}.{name}")
"""

# Run in a child process with the side's checkout first on sys.path. Prints one JSON line.
CHILD = (
    SIDE_IMPORT
    + r"""
import json, resource, time
from pathlib import Path
import numpy as np
from safetensors.numpy import save_file
codec = side("codec")
Settings = side("config").Settings
Registry = side("registry").Registry

home, path, version, parent = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], sys.argv[5] or None
os.environ["MFSREG_CACHE_DIR"] = str(home / "node-cache")  # a remote pull's node cache: empty at first
reg = Registry(Settings.from_env({"MFSREG_HOME": str(home)}))
api_file = None
if sys.argv[7] == "server":  # the side's own API app in uvicorn in a thread; its client pushes
    import socket, threading, uvicorn
    api_app = importlib.import_module("mfsreg.api.app" if _PKG != "registry" else "api.app")
    api_file = api_app.__file__
    token = side("auth").create_token(reg.engine, "admin")
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(api_app.create_app(registry=reg), log_config=None, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.005)
    reg = side("client.remote").RemoteRegistry(f"http://127.0.0.1:{sock.getsockname()[1]}", token=token)
if sys.argv[6] == "warm":  # a small family of two versions: warms what a long-lived process has warm
    rng = np.random.default_rng(0)
    w = ((rng.standard_normal(3 << 20) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    save_file({"w": w.reshape(-1, 1024)}, str(home / "w1.safetensors"))
    save_file({"w": (w + (rng.integers(0, 3, w.size) == 0)).astype(np.uint16).reshape(-1, 1024)}, str(home / "w2.safetensors"))
    reg.push(home / "w1.safetensors", "warm-up", "v1")
    reg.push(home / "w2.safetensors", "warm-up", "v2", parent="v1")
op = sys.argv[8]
if op == "pull" and sys.argv[6] == "warm":  # the pull's path warmed as well
    reg.pull("warm-up", "v2", home / "w2-out.safetensors")
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if op == "push":
    result = reg.push(path, "family", version, parent=parent)
else:  # the version pushed into the template: rebuilt (embedded) or fetched into an empty node cache
    result = reg.pull("family", version, home / "out.safetensors")
r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
reg.close()
if api_file is not None:
    server.should_exit = True
print(json.dumps({"api": api_file, "user": r1.ru_utime - r0.ru_utime, "system": r1.ru_stime - r0.ru_stime, "wall": wall,
                  "logical_bytes": result.logical_bytes, "new_bytes": getattr(result, "new_bytes", 0),
                  "package": core.__file__,
                  "c_module": getattr(codec._grouping, "__file__", None) if codec._grouping is not None else None}))
"""
)


def run(cmd: list[str], cwd: Path) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed in {cwd}:\n{out.stderr.strip()[-2000:]}")
    return out.stdout


def build(root: Path) -> Path:
    """Build ``root``'s C module in place with this interpreter."""
    run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], root)
    return root


def drop_worktree(where: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=REPO, capture_output=True)
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def checkout(rev: str, where: Path) -> Path:
    """A worktree of ``rev`` at ``where`` (a fresh one each run)."""
    drop_worktree(where)
    run(["git", "worktree", "add", "--detach", str(where), rev], REPO)
    return where


@contextmanager
def two_sides(rev: str, against: str | None, work: Path) -> Iterator[dict[str, Path]]:
    """label -> checkout: ``rev`` under work/a and ``against`` under work/b (None: the working tree),
    each with its C module built; the worktrees are removed afterwards."""
    if against == rev:
        raise SystemExit("--against names the same revision: nothing to compare")
    try:
        sides = {rev: build(checkout(rev, work / "a"))}
        sides[against or "working tree"] = build(checkout(against, work / "b") if against else REPO)
        yield sides
    finally:
        drop_worktree(work / "a")
        if against:
            drop_worktree(work / "b")


def child_result(root: Path, code: str, args: list[str], *modules: str) -> dict:
    """Run ``code`` for the checkout ``root`` in a fresh interpreter; its last line of output, as
    JSON. Each of ``modules`` (keys of that JSON naming imported files) must be the checkout's own."""
    out = run([sys.executable, "-c", code, str(root), *args], REPO)
    doc = json.loads(out.strip().splitlines()[-1])
    for key in modules:
        if not doc.get(key) or not Path(doc[key]).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"the child for {root} imported {key} {doc.get(key)}: not that checkout's own")
    return doc


def push(
    root: Path,
    home: Path,
    path: Path,
    version: str,
    parent: str | None,
    warm: bool,
    through: str = "embedded",
    op: str = "push",
) -> dict:
    """One push (``op`` "pull": one pull of ``version``, pushed already) in a fresh process;
    ``through`` "server": to (from) the side's API app in uvicorn in a thread of that process, by
    its remote client, the process's CPU counting both."""
    # setup.py builds the module optionally: a failed build would quietly measure the numpy path
    checked = ("package", "c_module") + (("api",) if through == "server" else ())
    args = [str(home), str(path), version, parent or "", "warm" if warm else "cold", through, op]
    return child_result(root, CHILD, args, *checked)


def compare_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The arguments both comparisons take: two revisions, how many pairs, the family and the result file."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("rev", help="the revision to compare (e.g. the commit before a change)")
    ap.add_argument("--against", default=None, help="the other revision (default: the working tree)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--out", default=out, help="file name under benchmarks/results/")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = compare_parser("CPU of one push under two revisions, interleaved", "compare_ingest.json")
    ap.add_argument(
        "--member",
        default="full-medical",
        choices=list(MEMBERS),
        help="the member pushed; onto a registry holding its parent, or an empty one for the base",
    )
    ap.add_argument(
        "--through",
        default="embedded",
        choices=["embedded", "server"],
        help="embedded: Registry.push; server: RemoteRegistry.push to the side's API app in the same process",
    )
    ap.add_argument(
        "--op",
        default="push",
        choices=["push", "pull"],
        help="pull: the member pushed into the template, pulled (embedded: rebuilt; server: into an empty node cache)",
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    paths = generate(args.data, args.scale, verbose=True)
    parent = MEMBERS[args.member]
    work = args.data / "compare"
    work.mkdir(parents=True, exist_ok=True)
    templates = {}
    with two_sides(args.rev, args.against, work) as sides:
        try:
            anchors.prewarm([paths[args.member]] + ([paths[parent]] if parent else []))
            for label, root in sides.items():
                templates[label] = Path(tempfile.mkdtemp(prefix="template-", dir=work))
                if parent:  # the base is pushed onto an empty registry
                    push(root, templates[label], paths[parent], parent, None, warm=False)
                if args.op == "pull":  # and the member too, to be pulled
                    push(root, templates[label], paths[args.member], args.member, parent, warm=False)
            pairs = []
            for i in range(args.pairs):
                pair = {}
                order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # take turns going first
                for label in order:
                    root = sides[label]
                    home = Path(tempfile.mkdtemp(prefix="push-", dir=work))
                    shutil.rmtree(home)
                    shutil.copytree(templates[label], home)
                    try:
                        pair[label] = push(
                            root, home, paths[args.member], args.member, parent, True, args.through, args.op
                        )
                    finally:
                        shutil.rmtree(home, ignore_errors=True)
                pairs.append(pair)
                cpu = {k: v["user"] + v["system"] for k, v in pair.items()}
                print(
                    f"pair {i + 1}/{args.pairs}: " + ", ".join(f"{k} {c:.2f} CPU-s" for k, c in cpu.items()), flush=True
                )
        finally:
            for t in templates.values():
                shutil.rmtree(t, ignore_errors=True)

    a, b = list(sides)
    ratios = [(p[b]["user"] + p[b]["system"]) / (p[a]["user"] + p[a]["system"]) for p in pairs]
    doc = {
        "machine": machine_info(),
        "params": {
            "member": args.member,
            "parent": parent,
            "through": args.through,
            "op": args.op,
            "pairs": args.pairs,
            "scale": args.scale,
            "sides": {a: args.rev, b: args.against},
        },
        "pairs": pairs,
        "ratios": ratios,
        "ratio_median": median(ratios),
    }
    finish(args.out, doc, report, t_start)


def report(doc: dict) -> str:
    a, b = list(doc["params"]["sides"])
    logical = doc["pairs"][0][a]["logical_bytes"]
    rows = []
    for i, (p, r) in enumerate(zip(doc["pairs"], doc["ratios"]), 1):
        ca, cb = (p[a]["user"] + p[a]["system"]), (p[b]["user"] + p[b]["system"])
        rows.append([i, f"{ca:.2f}", f"{logical / ca / MB:.0f}", f"{cb:.2f}", f"{logical / cb / MB:.0f}", f"{r:.2f}"])
    return "\n".join(
        [
            f"## {doc['params']['member']} {doc['params'].get('op', 'push')}ed by two revisions, interleaved"
            f" ({logical / MB:,.1f} MB logical,"
            f" {doc['params'].get('through', 'embedded')})",
            "",
            table(["pair", f"{a} CPU s", "MB per CPU-s", f"{b} CPU s", "MB per CPU-s", f"{b} / {a}"], rows),
            "",
            f"Median ratio: {doc['ratio_median']:.2f}",
            "",
        ]
    )


if __name__ == "__main__":
    main()
