"""The Hub API's download speed: `snapshot_download` of a member beside the same file served static.

    python -m benchmarks.bench_hub [--scale 1] [--runs 3] [--member lora-chat]

An embedded registry (SQLite, packs on local disk) holds the base and one member of
benchmarks/family.py (1.16 GB at scale 1), pushed with its parent. One uvicorn server process on
loopback (this module's ``app``) runs the API with the family's folder mounted as static files
(Starlette's StaticFiles), so both sides cross the same server and socket, and neither shares an
interpreter with the client. Each run, in turn: the real `huggingface_hub.snapshot_download`
of FAMILY/MEMBER into a fresh cache (every chunk rebuilt and checked as it is sent), and a plain
streamed GET of the member's file from /static/ written to a fresh file (the anchor). Every timed
step starts with no dirty pages (os.sync()); the downloaded file is compared with the source once.
Medians of --runs; the gate is speed >= 0.5x the anchor's (time ratio anchor/ours).

Writes benchmarks/results/hub.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import FAMILY, GB, finish, fresh_registry, machine_info, median, spread, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, generate

GATE = 0.5


def make_app():
    """The server process's app: the API on MFSREG_HOME's registry, BENCH_STATIC_DIR at /static."""
    from fastapi.staticfiles import StaticFiles

    from mfsreg.api.app import create_app

    app = create_app()
    app.mount("/static", StaticFiles(directory=os.environ["BENCH_STATIC_DIR"]), name="static")
    return app


def _serve(home: Path, static: Path) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MFSREG_HOME": str(home), "MFSREG_ANONYMOUS_READ": "1", "BENCH_STATIC_DIR": str(static)}
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "benchmarks.bench_hub:make_app", "--port", str(port)]
    proc = subprocess.Popen(cmd + ["--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return url, proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the benchmark's server did not start")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def plain_get(url: str, dest: Path) -> int:
    """The anchor: one streamed GET written to ``dest``, synced as huggingface_hub leaves its file."""
    n = 0
    with httpx.stream("GET", url, timeout=120) as r, open(dest, "wb") as f:
        r.raise_for_status()
        for block in r.iter_bytes(1 << 20):
            n += f.write(block)
    return n


def run(scale: float, runs: int, member: str, data: Path) -> dict:
    from huggingface_hub import snapshot_download

    paths = generate(data, scale)
    src = paths[member]
    work = Path(tempfile.mkdtemp(prefix="bench-hub-", dir=data))
    with fresh_registry(work) as (reg, home):
        for m in (MEMBERS[member], member):
            if m is not None:
                reg.push(paths[m], FAMILY, m, parent=MEMBERS[m])
        url, server = _serve(home, src.parent)
        ours, anchor, checked = [], [], False
        try:
            for k in range(runs):
                cache = work / f"hf-{k}"
                os.sync()
                t0 = time.perf_counter()
                folder = Path(snapshot_download(f"{FAMILY}/{member}", endpoint=url, cache_dir=cache, token=False))
                ours.append(time.perf_counter() - t0)
                got = folder / "model.safetensors"
                if not checked:
                    assert _sha256(got) == _sha256(src), "the downloaded file differs from the pushed one"
                    checked = True
                shutil.rmtree(cache)
                dest = work / "static.bin"
                os.sync()
                t0 = time.perf_counter()
                plain_get(f"{url}/static/{src.name}", dest)
                anchor.append(time.perf_counter() - t0)
                dest.unlink()
        finally:
            server.terminate()
            server.wait(timeout=30)
    shutil.rmtree(work, ignore_errors=True)
    size = src.stat().st_size
    return {
        "scale": scale,
        "member": member,
        "bytes": size,
        "ours_s": ours,
        "anchor_s": anchor,
        "ours_gbps": size / median(ours) / GB,
        "anchor_gbps": size / median(anchor) / GB,
        "speed_ratio": median(anchor) / median(ours),
    }


def report(doc: dict) -> str:
    r = doc["result"]
    rows = [
        [
            "snapshot_download (mfsreg Hub API)",
            f"{median(r['ours_s']):.3g}",
            spread(r["ours_s"]),
            f"{r['ours_gbps']:.2f}",
        ],
        ["static file, same server", f"{median(r['anchor_s']):.3g}", spread(r["anchor_s"]), f"{r['anchor_gbps']:.2f}"],
    ]
    met = "met" if r["speed_ratio"] >= GATE else "NOT met"
    return (
        f"Hub download of {FAMILY}/{r['member']} ({r['bytes'] / GB:.2f} GB), median of {len(r['ours_s'])} runs\n\n"
        + table(["way", "median s", "range s", "GB/s"], rows)
        + f"\n\nspeed vs the static file: {r['speed_ratio']:.2f}x (gate >= {GATE}x: {met})"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--member", default="lora-chat", choices=[m for m in MEMBERS])
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    t_start = time.perf_counter()
    doc = {"params": {**vars(args), "data": str(args.data)}, "gate": GATE}
    doc["result"] = run(args.scale, args.runs, args.member, args.data)
    doc["machine"] = machine_info()
    finish("hub.json", doc, report, t_start)


if __name__ == "__main__":
    main()
