"""The inference node: pulls through the node cache, tensors from it, and in-place version switches.

    python -m benchmarks.bench_node [--scale 1.0] [--runs 3] [--data DIR] [--device cpu|cuda]

Method. One stack as in bench_api.py (moto's S3 server, a scratch Postgres database and
`mfsreg serve`, on loopback) receives base, lora-chat, vocab-ext and full-medical through the API
(RemoteRegistry.push, parent base), once. The files lie in the page cache (read once before).
Then each figure is the median of --runs, measured in one process:

- anchor A: boto3 download_file of the member file from the same S3 endpoint (a plain bucket,
  boto3's default TransferConfig), then safetensors.torch.load_file of the downloaded file; and,
  since moto serves download_file's ranged GETs slowly, one whole-object get_object streamed to a
  file (moto's fast path). The time gate is checked against both.
- cold pull: RemoteRegistry.pull of a member into a file through a fresh, empty NodeCache
  (everything crosses the network): seconds and fetched (payload) bytes. Members: lora-chat
  (mostly duplicate of base) and full-medical (all deltas: their bases come along).
- pull with the base cached: a fresh NodeCache warmed, untimed, by
  registry.client.warm.warm_cache(own RemoteRegistry, family, "base") (the base tier), then the
  timed pull of lora-chat. Shared fraction = raw bytes of lora-chat's chunks that base also uses /
  lora-chat's logical bytes (from the two version documents' manifests). Gates: fetched bytes <=
  (1 - shared fraction) x logical bytes, and seconds <= 0.3 x the boto3 download of the same file.
  The pull writes its file through the page cache, or around it with MFSREG_PULL_DIRECT=1 set
  (params.pull_writes says which way ran). Beside it, in each run, two
  write anchors from anchors.write_anchors: the local file copied by shutil.copyfile and synced,
  and its bytes written with O_DIRECT and synced: what writing the file durably costs each way.
  The share of the warmed chunk files the page cache holds as the timed pull begins is recorded:
  where memory is short they are read back from disk.
- tensors: registry.client.load_tensors(lora-chat, node=Node(url, token, warm cache dir)) beside
  safetensors.torch.load_file of the local file with its default backend ("mmap": on CPU it maps
  the page cache and reads nothing until the tensors are used) and with backend="pread" (bytes
  copied into fresh process memory). Each runs once untimed first (page cache, node cache and
  allocator warm), then in LOAD_REPS interleaved rounds; each round times the call and the first
  touch of every page after it ("ready"). Gated: load_tensors' ready speed >= 0.9x each
  load_file's ready speed; the bare call times are shown beside. load_tensors(verify=False), which
  trusts the cache as fetched instead of hashing every chunk again, is timed beside, not gated.
  The same rounds run twice per run: with the page cache as the files' writers left it (the node
  cache's chunk files as the fetch wrote them, or on later runs as the last loads read them back;
  the local file copied afresh each run), and after
  both were dropped from the page cache (anchors.drop_from_page_cache, as after a reboot or memory
  pressure; the untimed first load of each then reads them from disk, timed apart as "first"):
  then the page cache holds them as the loaders' own reads left them, in large folios or small,
  and a mapping's first touch costs accordingly. Each state is gated. As each state's first loads
  begin, the share of the node cache's chunk files and of the local file that the page cache holds
  is recorded (anchors.page_cache_resident): the run's downloads and cold pulls can push them out.
- switch: ResidentModel(family, "base", node) built from the warm cache, then .switch("lora-chat")
  and .switch("base") back: seconds and bytes copied, beside a full reload of the target
  (load_tensors of lora-chat from the warm cache). On the first run the switched tensors are
  compared bit for bit with load_file of lora-chat.

--chunk-size cuts the pushed members at another size than the registry's default (MFSREG_CHUNK_SIZE),
to see what the size does to loads: see benchmarks/page_mapping.py.

On a machine with a GPU, --device cuda puts tensors there (load_file with device="cuda" beside it);
the JSON records the device and whether CUDA was available. Writes benchmarks/results/node.json
and prints a markdown table with the gates.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch
from boto3.s3.transfer import TransferConfig
from safetensors.torch import load_file

from benchmarks import anchors
from benchmarks.bench_api import Stack
from benchmarks.common import FAMILY, MB, finish, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, Shape, generate
from mfsreg.registry.config import DEFAULT_CHUNK_SIZE, parse_size

NODE_MEMBERS = ("base", "lora-chat", "vocab-ext", "full-medical")
COLD = ("lora-chat", "full-medical")
DUP = "lora-chat"  # the mostly-duplicate member pulled with the base cached, loaded and switched to
PULL_GATE = 0.3  # warm-base pull seconds / boto3 download seconds
LOAD_GATE = 0.9  # load_tensors speed / load_file speed
LOAD_REPS = 5  # timed rounds of each loader per run (median)
LOADERS = ("load_tensors", "load_tensors_unverified", "load_file", "load_file_pread")
LOAD_KEYS = (*LOADERS, *(f"{n}_ready" for n in LOADERS))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one byte of every page of every tensor: what first use costs a loader that maps lazily."""
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Bench:
    def __init__(
        self, stack: Stack, url: str, paths: dict[str, Path], work: Path, device: str, chunk_size: int | None = None
    ):
        self.stack, self.url, self.token = stack, url, stack.token
        self.paths, self.work, self.device, self.chunk_size = paths, work, device, chunk_size

    def remote(self):
        from mfsreg.registry.client.remote import RemoteRegistry

        return RemoteRegistry(self.url, token=self.token, chunk_size=self.chunk_size)

    def fresh_dir(self, what: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{what}-", dir=self.work))

    # -- set-up -------------------------------------------------------------------------------

    def push(self) -> dict:
        out = {}
        with self.remote() as client:
            for m in NODE_MEMBERS:
                t0 = time.perf_counter()
                r = client.push(self.paths[m], FAMILY, m, parent=MEMBERS[m])
                out[m] = {
                    "seconds": time.perf_counter() - t0,
                    "logical_bytes": r.logical_bytes,
                    "sent_bytes": r.sent_bytes,
                    "new_bytes": r.new_bytes,
                }
        return out

    def upload_plain(self) -> str:
        self.bucket = f"plain-{uuid.uuid4().hex[:8]}"
        self.stack.s3.create_bucket(Bucket=self.bucket)
        for m in COLD:
            self.stack.s3.upload_file(str(self.paths[m]), self.bucket, m, Config=TransferConfig())
        return self.bucket

    def shared(self) -> dict:
        """Raw bytes of DUP's chunks that base also uses, from the version documents."""
        from mfsreg.registry.format.manifest import Manifest

        with self.remote() as r:
            dup, base = r.version_doc(FAMILY, DUP), r.version_doc(FAMILY, "base")
        base_ids = set(Manifest.from_doc(base["manifest"]).chunk_ids())
        man = Manifest.from_doc(dup["manifest"])
        logical = shared = 0
        for f in man.files:
            for c in f.chunks:  # every position counts, as logical bytes do
                logical += c.size
                shared += c.size if c.id in base_ids else 0
        distinct = man.chunk_ids()
        stored_new = sum(dup["chunks"][i][1] for i in distinct if i not in base_ids)
        return {
            "logical_bytes": dup["logical_bytes"],
            "chunk_bytes": logical,
            "shared_bytes": shared,
            "shared_fraction": shared / dup["logical_bytes"],
            "chunks": len(distinct),
            "shared_chunks": sum(1 for i in distinct if i in base_ids),
            "stored_bytes_not_in_base": stored_new,
            "base_chunk_ids": base_ids,
        }

    # -- measurements -------------------------------------------------------------------------

    def anchor(self, member: str) -> dict:
        dest = self.work / f"plain-{member}.safetensors"
        try:
            t0 = time.perf_counter()
            self.stack.s3.download_file(self.bucket, member, str(dest), Config=TransferConfig())
            t1 = time.perf_counter()
            tensors = load_file(str(dest), device=self.device)
            _sync(self.device)
            t2 = time.perf_counter()
            del tensors
            dest.unlink()
            # moto answers the ranged GETs of download_file slowly; one whole-object GET is its fast path
            t3 = time.perf_counter()
            body = self.stack.s3.get_object(Bucket=self.bucket, Key=member)["Body"]
            with open(dest, "wb") as f:
                shutil.copyfileobj(body, f, 8 << 20)
            get_s = time.perf_counter() - t3
        finally:
            dest.unlink(missing_ok=True)
        return {"download_s": t1 - t0, "load_file_s": t2 - t1, "total_s": t2 - t0, "get_object_s": get_s}

    def _pull(self, member: str, cache, verify: bool, what: str) -> dict:
        """Timed pull of ``member`` into a file through ``cache``, checked against its source on request."""
        out = self.work / f"pulled-{member}.safetensors"
        try:
            with self.remote() as r:
                t0 = time.perf_counter()
                res = r.pull(FAMILY, member, out, cache=cache)
                wall = time.perf_counter() - t0
            ok = anchors.file_sha256(out) == anchors.file_sha256(self.paths[member]) if verify else None
            if ok is False:
                raise SystemExit(f"{what} of {member} differs from its source file")
        finally:
            out.unlink(missing_ok=True)
        return {
            "seconds": wall,
            "fetched_bytes": res.fetched_bytes,
            "cached_bytes": res.cached_bytes,
            "logical_bytes": res.logical_bytes,
            "verified": ok,
        }

    @contextmanager
    def fresh_cache(self, what: str):
        from mfsreg.registry.client.cache import NodeCache

        cache_dir = self.fresh_dir(what)
        cache = NodeCache(cache_dir)
        try:
            yield cache
        finally:
            cache.close()
            shutil.rmtree(cache_dir, ignore_errors=True)

    def cold_pull(self, member: str, verify: bool) -> dict:
        with self.fresh_cache("cold-cache") as cache:
            return self._pull(member, cache, verify, "cold pull")

    def warm_base_pull(self, shared: dict, verify: bool) -> dict:
        from mfsreg.registry.client.warm import warm_cache

        with self.fresh_cache("warm-cache") as cache:
            t0 = time.perf_counter()
            warm = warm_cache(self.remote(), FAMILY, "base", cache=cache)  # closes the remote it is given
            warm_s = time.perf_counter() - t0
            base_ids = shared["base_chunk_ids"]
            covered = sum(1 for i in base_ids if cache.has(i))
            cached, total = anchors.page_cache_resident(list((cache.root / "chunks").glob("*/*")))
            out = self._pull(DUP, cache, verify, "pull with the base cached")
        written = anchors.write_anchors(self.paths[DUP], self.work)
        return {
            **out,
            **written,
            "warm_seconds": warm_s,
            "warm_fetched_bytes": warm["fetched_bytes"],
            "warm_chunks": warm["chunks"],
            "base_chunks_cached": covered,
            "base_chunks": len(base_ids),
            "chunk_files_resident": cached / total if total else None,
        }

    def loads(self, node, dropped: bool = False) -> dict:
        """load_tensors from the warm cache beside load_file (default backend and pread) of the local file.

        Each loader runs once untimed (page cache and node cache warm, allocator in the same state),
        then LOAD_REPS timed rounds, interleaved; each round times the load and then the first touch
        of every page of the tensors (``ready_s`` = load + touch): a lazy loader pays its reads there.
        ``dropped``: the chunk files and the local file leave the page cache first; the untimed first
        loads read them back (their ready times are kept as ``<loader>_first``)."""
        from mfsreg.registry.client import load_tensors

        path = str(self.work / f"local-{DUP}.safetensors")
        if dropped:
            gc.collect()
            anchors.drop_from_page_cache([path, *(node.cache.root / "chunks").glob("*/*")])
        else:
            # Written afresh, as a download writes it: the page cache then holds it as writes leave it,
            # not as an earlier reader did. (The chunk files are as the fetch wrote them on run 1; on
            # later runs, as the loads after the last drop read them back.)
            with open(self.paths[DUP], "rb") as src, open(path, "wb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
        # how much of each loader's files the page cache holds as the first loads start: the other
        # steps of a run (downloads, moto's objects, the cold caches) can push the chunk files out
        chunk_files = list((node.cache.root / "chunks").glob("*/*"))
        cached, total = anchors.page_cache_resident(chunk_files)
        out: dict = {"chunk_files_resident": cached / total if total else None}
        cached, total = anchors.page_cache_resident([path])
        out["local_file_resident"] = cached / total if total else None
        variants = {
            "load_tensors": lambda: load_tensors(FAMILY, DUP, device=self.device, node=node),
            "load_tensors_unverified": lambda: load_tensors(FAMILY, DUP, device=self.device, node=node, verify=False),
            "load_file": lambda: load_file(path, device=self.device),
            "load_file_pread": lambda: load_file(path, device=self.device, backend="pread"),
        }
        usable = {}
        for name, fn in variants.items():
            try:
                t0 = time.perf_counter()
                tensors = fn()
                _sync(self.device)
                _touch(tensors)
                _sync(self.device)
                out[name + "_first"] = time.perf_counter() - t0
                out.setdefault("tensor_bytes", _nbytes(tensors))
                del tensors
                usable[name] = fn
            except TypeError as exc:  # an older safetensors without the backend argument (or mfsreg without verify)
                out[name] = None
                out[name + "_error"] = str(exc)
        times: dict = {name: ([], []) for name in usable}
        for _ in range(LOAD_REPS):
            for name, fn in usable.items():
                t0 = time.perf_counter()
                tensors = fn()
                _sync(self.device)
                t1 = time.perf_counter()
                _touch(tensors)
                _sync(self.device)
                t2 = time.perf_counter()
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t0)
                del tensors
        for name, (load, ready) in times.items():
            out[name], out[name + "_ready"] = median(load), median(ready)
        return out

    def switch(self, node, verify: bool) -> dict:
        from mfsreg.registry.client import ResidentModel, load_tensors

        t0 = time.perf_counter()
        rm = ResidentModel(FAMILY, "base", device=self.device, node=node)
        _sync(self.device)
        init_s = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            copied = rm.switch(DUP)
            _sync(self.device)
            to_s = time.perf_counter() - t0
            same = None
            if verify:
                ref = load_file(str(self.paths[DUP]), device=self.device)
                same = set(ref) == set(rm.tensors) and all(
                    torch.equal(ref[n].view(-1).view(torch.uint8), rm.tensors[n].view(-1).view(torch.uint8))
                    for n in ref
                )
                del ref
                if not same:
                    raise SystemExit(f"ResidentModel.switch({DUP!r}) does not hold the tensors of {DUP}")
            t0 = time.perf_counter()
            copied_back = rm.switch("base")
            _sync(self.device)
            back_s = time.perf_counter() - t0
            resident = _nbytes(rm.tensors)
        finally:
            rm.close()
            del rm
        t0 = time.perf_counter()
        tensors = load_tensors(FAMILY, DUP, device=self.device, node=node)
        _sync(self.device)
        reload_s = time.perf_counter() - t0
        reload_bytes = _nbytes(tensors)
        del tensors
        return {
            "init_base_s": init_s,
            "switch_s": to_s,
            "switch_bytes": copied,
            "switch_back_s": back_s,
            "switch_back_bytes": copied_back,
            "reload_s": reload_s,
            "reload_bytes": reload_bytes,
            "resident_bytes": resident,
            "verified": same,
        }


def run_all(bench: Bench, runs: int) -> dict:
    from mfsreg.registry.client import Node, load_tensors

    shared = bench.shared()
    bench.upload_plain()
    warm_dir = bench.fresh_dir("node-cache")
    node = Node(bench.url, bench.token, str(warm_dir))
    try:
        # warm the long-lived node cache (lora-chat and base) and the page cache, untimed
        load_tensors(FAMILY, DUP, device=bench.device, node=node)
        load_tensors(FAMILY, "base", device=bench.device, node=node)
        load_file(str(bench.paths[DUP]), device=bench.device)
        out = {
            "anchor": {m: [] for m in COLD},
            "cold": {m: [] for m in COLD},
            "warm_base": [],
            "loads": [],
            "loads_dropped": [],
            "switch": [],
        }
        for i in range(runs):
            t0 = time.perf_counter()
            for m in COLD:
                out["anchor"][m].append(bench.anchor(m))
                out["cold"][m].append(bench.cold_pull(m, verify=(i == 0)))
            out["warm_base"].append(bench.warm_base_pull(shared, verify=(i == 0)))
            out["loads"].append(bench.loads(node))
            out["loads_dropped"].append(bench.loads(node, dropped=True))
            out["switch"].append(bench.switch(node, verify=(i == 0)))
            print(f"run {i + 1}/{runs} done in {time.perf_counter() - t0:.1f} s", flush=True)
        out["node_cache"] = node.cache.stats()
    finally:
        node.close()
        shutil.rmtree(warm_dir, ignore_errors=True)
    shared.pop("base_chunk_ids")
    out["shared"] = shared
    return out


def _med(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return median(vals) if vals else None


def summarise(raw: dict) -> dict:
    s: dict = {"anchor": {}, "cold": {}}
    for m in COLD:
        s["anchor"][m] = {
            k: _med(raw["anchor"][m], k) for k in ("download_s", "load_file_s", "total_s", "get_object_s")
        }
        rows = raw["cold"][m]
        s["cold"][m] = {
            "seconds": _med(rows, "seconds"),
            "fetched_bytes": rows[0]["fetched_bytes"],
            "logical_bytes": rows[0]["logical_bytes"],
            "verified": rows[0]["verified"],
        }
        s["cold"][m]["vs_download"] = s["cold"][m]["seconds"] / s["anchor"][m]["download_s"]
        s["cold"][m]["vs_download_and_load"] = s["cold"][m]["seconds"] / s["anchor"][m]["total_s"]
    w = raw["warm_base"]
    sh = raw["shared"]
    s["warm_base"] = {
        k: _med(w, k) for k in ("seconds", "warm_seconds", "copy_fsync_s", "direct_fsync_s", "chunk_files_resident")
    }
    s["warm_base"].update(
        {
            k: w[0][k]
            for k in (
                "fetched_bytes",
                "cached_bytes",
                "logical_bytes",
                "verified",
                "warm_fetched_bytes",
                "warm_chunks",
                "base_chunks_cached",
                "base_chunks",
            )
        }
    )
    s["warm_base"]["shared_fraction"] = sh["shared_fraction"]
    s["warm_base"]["shared_fraction_observed"] = w[0]["cached_bytes"] / w[0]["logical_bytes"]
    s["warm_base"]["moved_limit_bytes"] = (1 - sh["shared_fraction"]) * sh["logical_bytes"]
    s["warm_base"]["vs_download"] = s["warm_base"]["seconds"] / s["anchor"][DUP]["download_s"]
    s["warm_base"]["vs_get_object"] = s["warm_base"]["seconds"] / s["anchor"][DUP]["get_object_s"]
    for state in ("loads", "loads_dropped"):
        rows = raw.get(state) or []
        if rows:
            s[state] = {
                k: _med(rows, k)
                for k in (*LOAD_KEYS, *(f"{n}_first" for n in LOADERS), "chunk_files_resident", "local_file_resident")
            }
            s[state]["tensor_bytes"] = rows[0]["tensor_bytes"]
    sw = raw["switch"]
    s["switch"] = {k: _med(sw, k) for k in ("init_base_s", "switch_s", "switch_back_s", "reload_s")}
    s["switch"].update(
        {k: sw[0][k] for k in ("switch_bytes", "switch_back_bytes", "reload_bytes", "resident_bytes", "verified")}
    )
    return s


def gates(s: dict) -> dict:
    w = s["warm_base"]
    out = {
        "warm_base_moved_bytes": {
            "value": w["fetched_bytes"],
            "limit": w["moved_limit_bytes"],
            "pass": w["fetched_bytes"] <= w["moved_limit_bytes"],
        },
        "warm_base_time_vs_download": {
            "value": w["vs_download"],
            "limit": PULL_GATE,
            "pass": w["vs_download"] <= PULL_GATE,
        },
        "warm_base_time_vs_get_object": {
            "value": w["vs_get_object"],
            "limit": PULL_GATE,
            "pass": w["vs_get_object"] <= PULL_GATE,
        },
    }
    # Gated: time until the tensors' bytes are in memory (load, then first touch of every page) against
    # both load_file backends. load_file's default backend maps the file and reads nothing until used,
    # so its bare call time is shown beside, not gated: no loader that reads and verifies can match it.
    # In both page-cache states (see loads): the files as written, and as the loaders read them back.
    for state, suffix in (("loads", ""), ("loads_dropped", "_after_drop")):
        ld = s.get(state)
        if ld is None:  # a results file from before the second state
            continue
        for ref in ("load_file", "load_file_pread"):
            if ld.get(ref) is None:
                out[f"load_tensors_vs_{ref}{suffix}"] = {
                    "value": None,
                    "limit": LOAD_GATE,
                    "pass": False,
                    "note": "anchor unavailable",
                }
                continue
            speed = ld[ref + "_ready"] / ld["load_tensors_ready"]  # speed ratio = inverse time ratio
            out[f"load_tensors_vs_{ref}{suffix}"] = {
                "value": speed,
                "limit": LOAD_GATE,
                "pass": speed >= LOAD_GATE,
                "bare_call_speed": ld[ref] / ld["load_tensors"],
            }
    return out


def unverified_speed(ld: dict) -> float | None:
    """load_tensors(verify=False)'s ready speed / the mmap load_file's: shown beside the gates, not
    one of them (the gate is on the default, which checks every chunk)."""
    if ld.get("load_tensors_unverified_ready") is None or ld.get("load_file") is None:
        return None
    return ld["load_file_ready"] / ld["load_tensors_unverified_ready"]


def _pf(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _load_rows(ld: dict, g: dict, suffix: str, what: str, p: dict) -> list[str]:
    """The tensors table of one page-cache state (see Bench.loads)."""
    n = ld["tensor_bytes"]
    rows = [
        [
            "load_tensors (node cache, warm)",
            f"{ld['load_tensors']:.3f}",
            f"{ld['load_tensors_ready']:.3f}",
            f"{n / ld['load_tensors_ready'] / MB:,.0f}",
            "",
            "",
        ]
    ]
    speed = unverified_speed(ld)
    if speed is not None:
        rows.append(
            [
                "load_tensors(verify=False): speed / load_file (mmap)",
                f"{ld['load_tensors_unverified']:.3f}",
                f"{ld['load_tensors_unverified_ready']:.3f}",
                f"{n / ld['load_tensors_unverified_ready'] / MB:,.0f}",
                f"{speed:.2f}x",
                "not gated (the default checks)",
            ]
        )
    for ref, label in (
        ("load_file", "load_file, default backend (mmap)"),
        ("load_file_pread", "load_file, backend=pread"),
    ):
        gg = g[f"load_tensors_vs_{ref}{suffix}"]
        if ld.get(ref) is None:
            rows.append([label, "-", "-", "-", "-", "unavailable"])
            continue
        rows.append(
            [
                label,
                f"{ld[ref]:.3f}",
                f"{ld[ref + '_ready']:.3f}",
                f"{n / ld[ref + '_ready'] / MB:,.0f}",
                f"{gg['value']:.2f}x",
                f"{_pf(gg['pass'])} (>= {LOAD_GATE}x)",
            ]
        )
    out = [
        f"### Tensors of {DUP} on {p['device']} ({n / MB:,.1f} MB; {what}; median of "
        f"{LOAD_REPS} interleaved rounds per run)",
        "",
        table(["loader", "call s", "ready s", "MB/s (ready)", "load_tensors speed / this (ready)", "gate"], rows),
        "",
    ]
    if ld.get("load_tensors_first") is not None:
        where = "reading the files back from disk" if suffix else "the files as the run's other steps left them"
        line = (
            f"First loads, {where} (untimed rounds above): load_tensors {ld['load_tensors_first']:.3f} s, "
            f"load_file {ld['load_file_first']:.3f} s (ready)."
        )
        if ld.get("chunk_files_resident") is not None:
            line += (
                f" As they began, the page cache held {ld['chunk_files_resident']:.0%} of the node cache's chunk "
                f"files and {ld['local_file_resident']:.0%} of the local file."
            )
        out += [line, ""]
    if p["device"] == "cpu" and not suffix:
        out += [
            '"ready" = the call plus the first touch of every page of every tensor. On CPU, load_file\'s default '
            "mmap backend returns tensors over the page cache and reads nothing until they are used, so its bare call "
            "is nearly free and its cost moves to first use; backend=pread copies the bytes into fresh memory. "
            "load_tensors maps the node cache's chunk files into each tensor and reads them once to check their ids.",
            "",
        ]
    return out


def report(doc: dict) -> str:
    s, g, p = doc["summary"], doc["gates"], doc["params"]
    size = {m: doc["family"]["files"][m] for m in COLD}
    out = [
        f"## mfsreg node benchmark (scale {p['scale']:g}, chunks of {p.get('chunk_size', DEFAULT_CHUNK_SIZE) >> 10} KiB, "
        f"device {p['device']}, median of {p['runs']} runs, "
        f"{doc['machine']['cpu_count']} CPUs, load {doc['machine']['loadavg_1_5_15']}; moto S3 + Postgres + mfsreg serve on loopback)",
        "",
    ]
    rows = []
    for m in COLD:
        a, c = s["anchor"][m], s["cold"][m]
        rows.append(
            [
                f"{m}: boto3 download_file + load_file",
                f"{size[m] / MB:,.1f}",
                f"{size[m] / MB:,.1f}",
                f"{a['download_s']:.3f} + {a['load_file_s']:.3f}",
                "",
                "",
            ]
        )
        rows.append(
            [
                f"{m}: boto3 get_object (one whole-object GET)",
                f"{size[m] / MB:,.1f}",
                f"{size[m] / MB:,.1f}",
                f"{a['get_object_s']:.3f}",
                "",
                "",
            ]
        )
        rows.append(
            [
                f"{m}: cold pull (empty node cache)",
                f"{c['logical_bytes'] / MB:,.1f}",
                f"{c['fetched_bytes'] / MB:,.1f}",
                f"{c['seconds']:.3f}",
                f"{c['vs_download']:.2f}x",
                "",
            ]
        )
    w = s["warm_base"]
    rows.append(
        [
            f"{DUP}: pull with base tier cached",
            f"{w['logical_bytes'] / MB:,.1f}",
            f"{w['fetched_bytes'] / MB:,.2f}",
            f"{w['seconds']:.3f}",
            f"{w['vs_download']:.2f}x ({w['vs_get_object']:.2f}x of get_object)",
            f"moved {_pf(g['warm_base_moved_bytes']['pass'])} (<= {w['moved_limit_bytes'] / MB:,.1f} MB); "
            f"time {_pf(g['warm_base_time_vs_download']['pass'])} / {_pf(g['warm_base_time_vs_get_object']['pass'])} "
            f"(<= {PULL_GATE}x)",
        ]
    )
    for key, what in (("copy_fsync_s", "shutil.copyfile + fsync"), ("direct_fsync_s", "O_DIRECT write + fsync")):
        if w.get(key) is not None:  # (results files from before these anchors lack them)
            rows.append(
                [
                    f"{DUP}: its local file, {what} (no check)",
                    f"{w['logical_bytes'] / MB:,.1f}",
                    "0",
                    f"{w[key]:.3f}",
                    f"pull / this: {w['seconds'] / w[key]:.2f}x",
                    "",
                ]
            )
    out += ["### Pulls", "", table(["what", "logical MB", "moved MB", "s", "s / boto3 download", "gate"], rows), ""]
    out += [
        f"Shared with base: {w['shared_fraction']:.3f} of {DUP}'s logical bytes (version documents); observed in the pull: "
        f"{w['shared_fraction_observed']:.3f}. The base-tier warm-up fetched {w['warm_fetched_bytes'] / MB:,.1f} MB "
        f"({w['warm_chunks']} chunks) in {w['warm_seconds']:.2f} s, untimed; it left {w['base_chunks_cached']}/{w['base_chunks']} "
        "of base's chunks cached."
        + (
            f" As the pull began, the page cache held {w['chunk_files_resident']:.0%} of those "
            "chunk files (median of the runs)."
            if w.get("chunk_files_resident") is not None
            else ""
        ),
        "",
    ]

    for state, suffix, what in (
        ("loads", "", "page cache and node cache warm, as their writers left them"),
        (
            "loads_dropped",
            "_after_drop",
            "after both files were dropped from the page cache, read back by each loader's untimed first load",
        ),
    ):
        if s.get(state) is not None:
            out += _load_rows(s[state], g, suffix, what, p)
    sw = s["switch"]
    rows = [
        ["ResidentModel(base) from the warm cache", f"{sw['init_base_s']:.3f}", f"{sw['resident_bytes'] / MB:,.1f}"],
        [f"switch base -> {DUP}", f"{sw['switch_s']:.3f}", f"{sw['switch_bytes'] / MB:,.1f}"],
        [f"switch {DUP} -> base", f"{sw['switch_back_s']:.3f}", f"{sw['switch_back_bytes'] / MB:,.1f}"],
        [
            f"full reload of {DUP} (load_tensors, warm cache)",
            f"{sw['reload_s']:.3f}",
            f"{sw['reload_bytes'] / MB:,.1f}",
        ],
    ]
    out += [
        f"### Switch (tensors on {p['device']}; switch checked bit for bit on run 1: {sw['verified']})",
        "",
        table(["step", "s", "MB copied"], rows),
        "",
        f"switch / full reload: {sw['switch_s'] / sw['reload_s']:.2f}x time, {sw['switch_bytes'] / sw['reload_bytes']:.3f}x bytes",
        "",
    ]
    bad = [k for k, v in g.items() if not v["pass"]]
    out += [f"Gates: {'all pass' if not bad else 'FAILED: ' + ', '.join(bad)}", ""]
    return "\n".join(out)


def _pull_writes(work: Path) -> str:
    """How the timed pulls wrote their file: around the page cache where asked and taken, else through it."""
    from mfsreg.registry.client import direct
    from mfsreg.registry.client.assemble import direct_writes

    if not direct_writes():
        return "page cache"
    return "O_DIRECT" if direct.taken(work) else "page cache (the filesystem refuses O_DIRECT)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU exists")
    ap.add_argument("--out", default="node.json", help="file name under benchmarks/results/")
    ap.add_argument("--chunk-size", default=None, help="cut the pushes at this size (e.g. 2M); default: the registry's")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.device.startswith("cuda") and not cuda:
        raise SystemExit("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")

    chunk_size = parse_size(args.chunk_size) if args.chunk_size else None
    t_start = time.perf_counter()
    family = generate(args.data, args.scale, verbose=True)
    paths = {m: family[m] for m in NODE_MEMBERS}
    anchors.prewarm(paths.values())
    work = Path(tempfile.mkdtemp(prefix="mfsreg-bench-node-", dir=args.data))
    stack = Stack(work)
    try:
        url = stack.start_api(f"reg-{uuid.uuid4().hex[:8]}")
        bench = Bench(stack, url, paths, work, args.device, chunk_size)
        t0 = time.perf_counter()
        pushes = bench.push()
        print(f"pushed {', '.join(NODE_MEMBERS)} through the API in {time.perf_counter() - t0:.1f} s", flush=True)
        raw = run_all(bench, args.runs)
        pull_writes = _pull_writes(work)
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)

    summary = summarise(raw)
    doc = {
        "machine": machine_info(),
        "params": {
            "scale": args.scale,
            "runs": args.runs,
            "device": args.device,
            "cuda_available": cuda,
            "chunk_size": chunk_size or DEFAULT_CHUNK_SIZE,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "note": ("no GPU on this machine: tensors on CPU" if not cuda else "GPU present"),
            "s3": "moto server (loopback)",
            "metadata": "postgres 127.0.0.1",
            "page_cache": "pre-warmed",
            "pull_writes": pull_writes,
            "members": list(NODE_MEMBERS),
            "torch": torch.__version__,
        },
        "family": {
            "shape": Shape.for_scale(args.scale).__dict__,
            "files": {m: p.stat().st_size for m, p in paths.items()},
        },
        "pushes": pushes,
        "summary": summary,
        "gates": gates(summary),
        "runs": {k: v for k, v in raw.items() if k != "shared"},
        "shared": raw["shared"],
    }
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    main()
