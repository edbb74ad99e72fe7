"""Push and pull through the API (Postgres + S3) beside plain boto3 transfers of the same files.

One run starts moto's S3 server and `mfsreg serve` (uvicorn) as separate processes on loopback, on a
scratch Postgres database, and measures, each as the median of --runs:
- anchor: boto3 upload_file / download_file of each file to / from the same S3 endpoint
- mfsreg: RemoteRegistry.push of the base into an empty registry (all new), then of members with
  the base stored (mostly-duplicate: lora-chat, vocab-ext; all new: full-medical), and pull of a
  member into a new file through a fresh, empty node cache (every chunk comes over HTTP)
moto's server answers the ranged GETs that boto3's download_file makes slowly (about 12 MB/s
here, against about 150 MB/s for multipart uploads; one whole-object get_object runs far faster,
see bench_node.py), so the download anchor flatters mfsreg's pulls. Ratios are the median mfsreg
time over the median anchor time, both taken over the same runs.

    python -m benchmarks.bench_api [--scale 1.0] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
import httpx
import psycopg
from boto3.s3.transfer import TransferConfig

from benchmarks.anchors import prewarm
from benchmarks.common import GB, machine_info, median, table, write_json
from benchmarks.family import DEFAULT_DIR, generate

PG_ADMIN = os.environ.get("MFSREG_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
MEMBERS = ("lora-chat", "vocab-ext", "full-medical")
MOSTLY_DUPLICATE = ("lora-chat", "vocab-ext")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not start")


class Stack:
    """moto S3 + scratch Postgres database + one `mfsreg serve`, all on loopback."""

    def __init__(self, work: Path):
        self.work = work
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
        self.env.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        port = free_port()
        self.s3_url = f"http://127.0.0.1:{port}"
        self.moto = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(self.s3_url, self.moto, "moto server")
        self.s3 = boto3.client("s3", endpoint_url=self.s3_url, region_name="us-east-1")
        self.db = f"mfsreg_bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{self.db}"')
        self.api = None

    def start_api(self, bucket: str, workers: int = 1) -> str:
        self.s3.create_bucket(Bucket=bucket)
        base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
        self.env.update(
            MFSREG_DATABASE_URL=f"{base}/{self.db}",
            MFSREG_BLOB_URL=f"s3://{bucket}/packs",
            MFSREG_S3_ENDPOINT_URL=self.s3_url,
            MFSREG_HOME=str(self.work / "server-home"),
        )
        mfsreg = str(Path(sys.executable).with_name("mfsreg"))
        subprocess.run([mfsreg, "db", "upgrade"], env=self.env, check=True, capture_output=True)
        tok = subprocess.run(
            [mfsreg, "token", "create", "--scope", "admin", "--json"],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        import json

        self.token = json.loads(tok)["token"]
        port = free_port()
        self.api_url = f"http://127.0.0.1:{port}"
        self.api = subprocess.Popen(
            [mfsreg, "serve", "--port", str(port), "--log-level", "warning", "--workers", str(workers)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(self.api_url + "/healthz", self.api, "mfsreg serve")
        return self.api_url

    def reset(self) -> None:
        """A fresh, empty registry: new bucket, schema dropped and recreated."""
        if self.api:
            self.api.terminate()
            self.api.wait()
        with psycopg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{self.db}", autocommit=True) as c:
            c.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")

    def close(self) -> None:
        if self.api:
            self.api.terminate()
            self.api.wait()
        self.moto.terminate()
        self.moto.wait()
        with psycopg.connect(PG_ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')


def plain_transfers(stack: Stack, paths: dict[str, Path], work: Path) -> dict[str, dict]:
    bucket = f"plain-{uuid.uuid4().hex[:8]}"
    stack.s3.create_bucket(Bucket=bucket)
    cfg = TransferConfig()  # boto3's defaults: what a team gets from `aws s3 cp` or upload_file
    out = {}
    for name, p in paths.items():
        t0 = time.perf_counter()
        stack.s3.upload_file(str(p), bucket, name, Config=cfg)
        up = time.perf_counter() - t0
        dest = work / f"plain-{name}"
        t0 = time.perf_counter()
        stack.s3.download_file(bucket, name, str(dest), Config=cfg)
        down = time.perf_counter() - t0
        dest.unlink()
        stack.s3.delete_object(Bucket=bucket, Key=name)
        out[name] = {"upload_s": up, "download_s": down}
    stack.s3.delete_bucket(Bucket=bucket)
    return out


def mfsreg_transfers(stack: Stack, paths: dict[str, Path], work: Path) -> dict[str, dict]:
    from mfsreg.registry.client.cache import NodeCache
    from mfsreg.registry.client.remote import RemoteRegistry

    url = stack.start_api(f"reg-{uuid.uuid4().hex[:8]}")
    out = {}
    with RemoteRegistry(url, token=stack.token) as client:
        for name, p in paths.items():
            t0 = time.perf_counter()
            r = client.push(p, "bench", name, parent=None if name == "base" else "base")
            out[name] = {
                "push_s": time.perf_counter() - t0,
                "sent_bytes": r.sent_bytes,
                "logical_bytes": r.logical_bytes,
            }
        for name in paths:
            dest = work / f"pulled-{name}"
            cache_dir = work / f"node-cache-{name}"
            cache = NodeCache(cache_dir)  # a cold node: every chunk crosses the network
            t0 = time.perf_counter()
            r = client.pull("bench", name, dest, cache=cache)
            out[name]["pull_s"] = time.perf_counter() - t0
            out[name]["fetched_bytes"] = r.fetched_bytes
            cache.close()
            shutil.rmtree(cache_dir)
            dest.unlink()
    stack.reset()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    family = generate(args.data, args.scale)
    paths = {"base": family["base"], **{m: family[m] for m in MEMBERS}}
    prewarm(paths.values())
    work = Path(tempfile.mkdtemp(prefix="mfsreg-bench-api-", dir=args.data))
    stack = Stack(work)
    plain, ours = [], []
    try:
        for _ in range(args.runs):
            plain.append(plain_transfers(stack, paths, work))
            ours.append(mfsreg_transfers(stack, paths, work))
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)  # the stack's own files are gone; this removes the folder
    rows, doc_rows = [], []
    for name, p in paths.items():
        size = p.stat().st_size
        up = median([r[name]["upload_s"] for r in plain])
        down = median([r[name]["download_s"] for r in plain])
        push = median([r[name]["push_s"] for r in ours])
        pull = median([r[name]["pull_s"] for r in ours])
        sent = ours[0][name]["sent_bytes"]
        kind = (
            "new (empty registry)"
            if name == "base"
            else "mostly-duplicate"
            if name in MOSTLY_DUPLICATE
            else "all new (dense fine-tune)"
        )
        doc_rows.append(
            dict(
                member=name,
                kind=kind,
                bytes=size,
                sent_bytes=sent,
                plain_upload_s=up,
                mfsreg_push_s=push,
                push_ratio=push / up,
                plain_download_s=down,
                mfsreg_pull_s=pull,
                pull_ratio=pull / down,
            )
        )
        rows.append(
            [
                name,
                kind,
                f"{size / GB:.2f}",
                f"{sent / GB:.3f}",
                f"{up:.2f}",
                f"{push:.2f}",
                f"{push / up:.2f}x",
                f"{down:.2f}",
                f"{pull:.2f}",
                f"{pull / down:.2f}x",
            ]
        )
    doc = {
        "machine": machine_info(),
        "params": {
            "scale": args.scale,
            "runs": args.runs,
            "s3": "moto server (loopback)",
            "metadata": "postgres 127.0.0.1",
            "page_cache": "pre-warmed",
        },
        "results": doc_rows,
        "runs": {"plain": plain, "mfsreg": ours},
    }
    path = write_json("api.json", doc)
    print(
        table(
            [
                "member",
                "kind",
                "GB",
                "sent GB",
                "boto3 upload s",
                "mfsreg push s",
                "push/upload",
                "boto3 download s",
                "mfsreg pull s",
                "pull/download",
            ],
            rows,
        )
    )
    print(f"\nresults: {path}")
    print(
        "gate: mostly-duplicate push <= 0.25x plain upload:",
        all(r["push_ratio"] <= 0.25 for r in doc_rows if r["member"] in MOSTLY_DUPLICATE),
    )


if __name__ == "__main__":
    main()
