"""load_tensors and switch under two revisions of the node client, measured as interleaved pairs.

    python -m benchmarks.compare_load REV [--against REV2] [--pairs 3] [--cold]

The node-side counterpart of compare_ingest (same method, same reason: this VM's speed swings
between hours, so two bench_node runs made at different times cannot show a 15% change). One
server (the working tree's code, Postgres, moto's S3) holds base and lora-chat; each side's client
runs in a fresh process with its own checkout first on sys.path, against one shared node cache that
a first, untimed load fills. A child loads lora-chat and maps it ``load_file`` by turns, nine times
each (and, where the side has it, ``load_tensors(verify=False)``), and times "ready" (the call plus the first touch of every page, as bench_node does); then it
switches a ResidentModel between base and lora-chat five times. The sides take turns going first.
Writes benchmarks/results/compare_load.json.

``--cold``: before those loads, each child twice drops the node cache's chunk files and the member's
file from the page cache (posix_fadvise DONTNEED, as after a reboot or memory pressure) and times
one ``load_tensors`` (checked) and one ``load_file`` from there, ready; the loads that follow then
find the page cache as those first reads left it (in large folios or small ones).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import anchors
from benchmarks.bench_api import Stack
from benchmarks.common import FAMILY, finish, machine_info, median, table
from benchmarks.compare_ingest import SIDE_IMPORT, child_result, compare_parser, two_sides
from benchmarks.family import generate
from mfsreg.registry.client.remote import RemoteRegistry

BASE, MEMBER = "base", "lora-chat"

# Run in a child process with the side's checkout first on sys.path. Prints one JSON line.
CHILD = (
    SIDE_IMPORT
    + r"""
import json, statistics, time
_client = side("client")
Node, ResidentModel, load_tensors = _client.Node, _client.ResidentModel, _client.load_tensors
import torch
from safetensors.torch import load_file

url, token, cache_dir, path, family, base, member, mode = sys.argv[2:10]
node = Node(url, token, cache_dir)

def _touch(tensors):  # here, not imported: both sides time the first touch with the same code
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()

load_tensors(family, member, node=node)  # untimed: imports, pools, page cache
load_file(path)
try:  # a revision with load_tensors(verify=False): it maps the cache's files without reading them again
    load_tensors(family, member, node=node, verify=False)
    trusting = True
except TypeError:
    trusting = False
cold_loads, cold_files = [], []
if mode == "cold":
    import gc, glob, importlib.util, os
    # the working tree's anchors.py by its path (the side's checkout may predate drop_from_page_cache)
    spec = importlib.util.spec_from_file_location("anchors", sys.argv[10])
    anchors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(anchors)
    def _drop():  # the chunk files and the file leave the page cache; gc first: a live mapping keeps pages
        gc.collect()
        anchors.drop_from_page_cache([path, *glob.glob(os.path.join(cache_dir, "chunks", "*", "*"))])
    for _ in range(2):
        _drop(); t0 = time.perf_counter(); t = load_tensors(family, member, node=node); _touch(t); cold_loads.append(time.perf_counter() - t0); del t
        _drop(); t0 = time.perf_counter(); t = load_file(path); _touch(t); cold_files.append(time.perf_counter() - t0); del t
loads, files, unverified = [], [], []
for _ in range(9):
    t0 = time.perf_counter(); t = load_tensors(family, member, node=node); _touch(t); loads.append(time.perf_counter() - t0); del t
    t0 = time.perf_counter(); t = load_file(path); _touch(t); files.append(time.perf_counter() - t0); del t
    if trusting:
        t0 = time.perf_counter(); t = load_tensors(family, member, node=node, verify=False); _touch(t)
        unverified.append(time.perf_counter() - t0); del t
resident = ResidentModel(family, base, node=node)
switches = []
for _ in range(5):
    t0 = time.perf_counter(); resident.switch(member); resident.switch(base); switches.append((time.perf_counter() - t0) / 2)
node.close()
print(json.dumps({"load_tensors_ready": statistics.median(loads), "load_file_ready": statistics.median(files),
                  "load_tensors_unverified_ready": statistics.median(unverified) if unverified else None,
                  "switch": statistics.median(switches), "package": core.__file__,
                  "load_tensors_cold": cold_loads or None, "load_file_cold": cold_files or None}))
"""
)


def child(root: Path, url: str, token: str, cache: Path, path: Path, cold: bool) -> dict:
    return child_result(
        root,
        CHILD,
        [url, token, str(cache), str(path), FAMILY, BASE, MEMBER, "cold" if cold else "warm", anchors.__file__],
        "package",
    )


def main(argv: list[str] | None = None) -> None:
    ap = compare_parser("load_tensors and switch under two revisions, interleaved", "compare_load.json")
    ap.add_argument("--cold", action="store_true", help="first time loads with the files dropped from the page cache")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    paths = generate(args.data, args.scale, verbose=True)
    anchors.prewarm([paths[BASE], paths[MEMBER]])
    work = args.data / "compare-load"
    work.mkdir(parents=True, exist_ok=True)
    pairs = []
    with two_sides(args.rev, args.against, work) as sides:
        scratch = Path(tempfile.mkdtemp(prefix="stack-", dir=work))
        stack = Stack(scratch)
        try:
            url = stack.start_api(f"reg-{uuid.uuid4().hex[:8]}")
            with RemoteRegistry(url, token=stack.token) as client:
                for name in (BASE, MEMBER):
                    client.push(paths[name], FAMILY, name)
            cache = scratch / "node-cache"
            for i in range(args.pairs):
                pair = {}
                for label in list(sides) if i % 2 == 0 else list(sides)[::-1]:  # take turns going first
                    pair[label] = child(sides[label], url, stack.token, cache, paths[MEMBER], args.cold)
                pairs.append(pair)
                print(
                    f"pair {i + 1}/{args.pairs}: "
                    + ", ".join(f"{k} {v['load_tensors_ready']:.3f} s" for k, v in pair.items()),
                    flush=True,
                )
        finally:
            stack.close()
            shutil.rmtree(scratch, ignore_errors=True)

    a, b = list(sides)
    ratios = {k: [p[b][k] / p[a][k] for p in pairs] for k in ("load_tensors_ready", "switch")}
    doc = {
        "machine": machine_info(),
        "params": {
            "pairs": args.pairs,
            "scale": args.scale,
            "member": MEMBER,
            "sides": {a: args.rev, b: args.against},
            "cold": args.cold,
        },
        "pairs": pairs,
        "ratios": ratios,
        "ratio_medians": {k: median(v) for k, v in ratios.items()},
    }
    finish(args.out, doc, report, t_start)


def report(doc: dict) -> str:
    a, b = list(doc["params"]["sides"])
    rows = [
        [
            i,
            f"{p[a]['load_tensors_ready']:.3f}",
            f"{p[b]['load_tensors_ready']:.3f}",
            f"{p[a]['load_file_ready']:.3f}",
            f"{p[b]['load_file_ready']:.3f}",
            f"{p[a]['switch']:.4f}",
            f"{p[b]['switch']:.4f}",
        ]
        for i, p in enumerate(doc["pairs"], 1)
    ]
    med = doc["ratio_medians"]
    return "\n".join(
        [
            f"## {doc['params']['member']} loaded by two revisions of the node client, interleaved (seconds, ready)",
            "",
            table(
                [
                    "pair",
                    f"load_tensors {a}",
                    f"load_tensors {b}",
                    f"load_file ({a}'s run)",
                    f"load_file ({b}'s run)",
                    f"switch {a}",
                    f"switch {b}",
                ],
                rows,
            ),
            "",
            f"Median ratio {b} / {a}: load_tensors {med['load_tensors_ready']:.2f}, switch {med['switch']:.2f}",
            "",
            *_unverified_lines(doc),
            *_cold_lines(doc),
        ]
    )


def _cold_lines(doc: dict) -> list[str]:
    """With --cold: the loads from files dropped from the page cache, each side's runs in order."""
    out = []
    for side in doc["params"]["sides"]:
        runs = [p[side] for p in doc["pairs"] if p[side].get("load_tensors_cold")]
        if runs:

            def fmt(key: str, runs: list = runs) -> str:
                return ", ".join(f"{x:.3f}" for r in runs for x in r[key])

            out += [
                f"{side}, dropped from the page cache: load_tensors ready {fmt('load_tensors_cold')} s; "
                f"load_file {fmt('load_file_cold')} s",
                "",
            ]
    return out


def _unverified_lines(doc: dict) -> list[str]:
    """load_tensors(verify=False) beside load_file of the same child, where a side has it."""
    out = []
    for side in doc["params"]["sides"]:
        runs = [
            (p[side]["load_tensors_unverified_ready"], p[side]["load_file_ready"], p[side]["load_tensors_ready"])
            for p in doc["pairs"]
            if p[side].get("load_tensors_unverified_ready") is not None
        ]
        if runs:
            speed = median([f / u for u, f, _ in runs])
            out += [
                f"{side}: load_tensors(verify=False) ready {median([u for u, _, _ in runs]):.3f} s; its speed / "
                f"load_file's (mmap) in the same child, median {speed:.2f}x (gate >= 0.9x); checked load_tensors "
                f"{median([f / c for _, f, c in runs]):.2f}x",
                "",
            ]
    return out


if __name__ == "__main__":
    main()
