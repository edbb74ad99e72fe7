"""Push and pull on the embedded default and on Postgres: byte-identical round trips and dedup."""

from __future__ import annotations

import filecmp
import os
import stat

import pytest
import torch

from mfsreg.registry.errors import Conflict, NotFound, StorageError
from mfsreg.registry.registry import Registry
from tests import synth
from tests.dialects import sqlite_only


def test_family_round_trip_is_byte_identical(reg, fam, tmp_path):
    results = {}
    for name, path in fam.items():
        results[name] = reg.push(path, "fam", name, parent=None if name == "base" else "base")
    # genuinely different members: each stores something new, none is a copy of another
    assert len({r.digest for r in results.values()}) == len(fam)
    assert all(r.new_bytes > 0 for r in results.values())
    for name, path in fam.items():
        out = tmp_path / f"{name}.out"
        reg.pull("fam", name, out)
        assert filecmp.cmp(out, path, shallow=False), name


def test_members_reuse_the_base_chunks(reg, fam):
    base = reg.push(fam["base"], "fam", "base")
    lora = reg.push(fam["lora-chat"], "fam", "lora-chat")
    vocab = reg.push(fam["vocab-ext"], "fam", "vocab-ext")
    # LoRA on q/v leaves embeddings, k/o, mlp and norms untouched: most chunks are reused
    assert lora.reused_chunks > lora.chunks // 2
    assert lora.new_bytes < base.new_bytes / 2
    # appended vocabulary rows change only the last chunk of two tensors, plus the header
    assert vocab.new_chunks == 3
    assert vocab.new_bytes < base.new_bytes / 5


def test_a_family_keeps_the_chunk_size_of_its_first_push(settings, fam, tmp_path):
    """Members dedup against each other only if cut alike: a registry whose own chunk size differs
    (a changed default, another MFSREG_CHUNK_SIZE) cuts a push at the family's size; a new family
    takes the registry's."""
    from dataclasses import replace

    from mfsreg.registry.registry import Registry

    with Registry(replace(settings, chunk_size=32 << 10), migrate=True) as reg:
        reg.push(fam["base"], "fam", "base")
        assert reg.family("fam").chunk_size == 32 << 10
    with Registry(replace(settings, chunk_size=128 << 10)) as reg:
        copy = reg.push(fam["base"], "fam", "base-again")
        lora = reg.push(fam["lora-chat"], "fam", "lora-chat", parent="base")
        other = reg.push(fam["base"], "other", "base")
        assert reg.family("fam").chunk_size == 32 << 10 and reg.family("other").chunk_size == 128 << 10
        _, manifest = reg.manifest("fam", "lora-chat")
        out = tmp_path / "lora.out"
        reg.pull("fam", "lora-chat", out)
    assert copy.new_chunks == 0 and copy.reused_chunks == copy.chunks  # cut alike: every chunk found
    assert lora.reused_chunks > lora.chunks // 2
    assert max(c.size for f in manifest.files for c in f.chunks[1:]) == 32 << 10
    assert other.chunks < copy.chunks  # the new family was cut at 128 KiB
    assert filecmp.cmp(out, fam["lora-chat"], shallow=False)


def test_repush_stores_no_new_bytes(reg, fam):
    first = reg.push(fam["base"], "fam", "v1")
    again = reg.push(fam["base"], "fam", "v1-again")
    same_name = reg.push(fam["base"], "fam", "v1")
    assert first.new_bytes > 0
    assert again.new_bytes == 0 and again.new_chunks == 0 and not again.existed
    assert same_name.existed and same_name.new_bytes == 0
    assert reg.stats("fam")["stored_bytes"] == first.new_bytes


@sqlite_only
def test_reordered_tensors_with_other_metadata_store_only_the_header(reg, tmp_path):
    tensors = synth.base_tensors()
    a = synth.write(tmp_path / "a.safetensors", tensors, {"note": "first"})
    reordered = dict(reversed(list(tensors.items())))
    b = synth.write(tmp_path / "b.safetensors", reordered, {"note": "second, other metadata", "x": "y"})
    assert a.read_bytes() != b.read_bytes()
    reg.push(a, "fam", "a")
    rb = reg.push(b, "fam", "b")
    _, manifest = reg.manifest("fam", "b")
    header = manifest.files[0].chunks[0]
    assert rb.new_chunks == 1
    assert reg.locate([header.id])[header.id].stored_size == rb.new_bytes
    reg.pull("fam", "b", tmp_path / "b.out")
    assert (tmp_path / "b.out").read_bytes() == b.read_bytes()


@sqlite_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_round_trip(reg, tmp_path, dtype):
    paths = synth.family(tmp_path / "f", dtype=dtype)
    for name, p in paths.items():
        reg.push(p, "fam", name)
    for name, p in paths.items():
        reg.pull("fam", name, tmp_path / "out.safetensors")
        assert filecmp.cmp(tmp_path / "out.safetensors", p, shallow=False)


@sqlite_only
def test_sharded_directory_with_side_files(reg, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    synth.sharded_dir(src, synth.base_tensors())
    (src / ".cache").mkdir()
    (src / ".cache" / "junk").write_text("skipped")
    res = reg.push(src, "fam", "sharded")
    assert res.files == 5  # two shards, the index, config.json, tokenizer.json
    out = tmp_path / "pulled"
    reg.pull("fam", "sharded", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir() if not p.name.startswith("."))
    for p in src.iterdir():
        if p.is_file():
            assert filecmp.cmp(p, out / p.name, shallow=False), p.name
    assert not (out / ".cache").exists()
    # the same tensors as one file share every tensor chunk with the shards
    single = synth.write(tmp_path / "single.safetensors", synth.base_tensors())
    r2 = reg.push(single, "fam", "single")
    assert r2.new_chunks == 1  # the header


@sqlite_only
def test_index_file_pushes_index_and_shards(reg, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    synth.sharded_dir(src, synth.base_tensors(), side_files=False)
    (src / "unrelated.txt").write_text("not part of the checkpoint")
    res = reg.push(src / "model.safetensors.index.json", "fam", "idx")
    assert res.files == 3
    reg.pull("fam", "idx", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )


def test_same_name_other_bytes_is_a_conflict(reg, fam):
    reg.push(fam["base"], "fam", "v1")
    with pytest.raises(Conflict):
        reg.push(fam["lora-chat"], "fam", "v1")


@sqlite_only
def test_unknown_parent_is_refused_before_storing(reg, fam):
    with pytest.raises(NotFound):
        reg.push(fam["base"], "fam", "v1", parent="nope")
    assert reg.stats()["stored_bytes"] == 0
    assert list(reg.blobs.list()) == []


@sqlite_only
def test_pull_into_existing_directory_for_single_file(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "v1")
    d = tmp_path / "dir"
    d.mkdir()
    reg.pull("fam", "v1", d)
    assert filecmp.cmp(d / fam["base"].name, fam["base"], shallow=False)


def test_delete_hands_children_to_the_grandparent(reg, fam):
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "lora", parent="base")
    reg.push(fam["full-med"], "fam", "lora-v2", parent="lora")
    reg.delete("fam", "lora")
    assert {v.name: v.parent for v in reg.versions("fam")} == {"base": None, "lora-v2": "base"}
    reg.delete("fam", "base")
    assert {v.name: v.parent for v in reg.versions("fam")} == {"lora-v2": None}


def test_delete_keeps_chunks_others_need(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "lora")
    res = reg.delete("fam", "base")
    assert res.released_chunks > 0
    with pytest.raises(NotFound):
        reg.manifest("fam", "base")
    reg.pull("fam", "lora", tmp_path / "l.out")
    assert filecmp.cmp(tmp_path / "l.out", fam["lora-chat"], shallow=False)


@sqlite_only
def test_a_single_file_pulled_into_a_directory_reports_the_file(reg, fam, tmp_path):
    reg.push(fam["lora-chat"], "fam", "chat")
    (tmp_path / "out").mkdir()
    res = reg.pull("fam", "chat", tmp_path / "out")
    assert res.path == str(tmp_path / "out" / fam["lora-chat"].name)
    assert filecmp.cmp(res.path, fam["lora-chat"], shallow=False)
    assert reg.pull("fam", "chat", tmp_path / "c.out").path == str(tmp_path / "c.out")


@sqlite_only
def test_a_pull_whose_pack_storage_lost_says_so_and_writes_nothing(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    for key in reg.blobs.list("packs/"):
        (reg.blobs.root / key).unlink()
    (tmp_path / "out").mkdir()
    with pytest.raises(
        StorageError, match="storage lost data .*missing.*MFSREG_BLOB_URL.*restore that blob from a backup"
    ):
        reg.pull("fam", "base", tmp_path / "out" / "base.safetensors")
    assert list((tmp_path / "out").iterdir()) == []  # nor a temp file left behind


@sqlite_only
@pytest.mark.parametrize("blocker", ["a directory where a file goes", "a file where a directory goes"])
def test_a_pull_whose_file_would_land_on_a_directory_writes_nothing(blocker, reg, tmp_path):
    """A directory already where one of the version's files goes (or a file where it needs a
    directory): refused before any file is written, naming the path (the rename failed after the
    files before it were written, and named its temp file)."""
    from mfsreg.registry.errors import InvalidRequest

    src = tmp_path / "ckpt"
    src.mkdir()
    synth.sharded_dir(src, synth.base_tensors())
    (src / "tok").mkdir()
    (src / "tok" / "vocab.txt").write_text("a b c")
    reg.push(src, "fam", "sharded")
    out = tmp_path / "pulled"
    out.mkdir()
    if blocker == "a directory where a file goes":
        (out / "tokenizer.json").mkdir()
        says = f"cannot write {out / 'tokenizer.json'}: a directory is there"
    else:
        (out / "tok").write_text("in the way")
        says = f"cannot write {out / 'tok' / 'vocab.txt'}: {out / 'tok'} is a file"
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(InvalidRequest, match=says.replace("(", r"\(")):
        reg.pull("fam", "sharded", out)
    assert sorted(p.name for p in out.iterdir()) == before


@sqlite_only
def test_a_directory_pull_that_fails_partway_leaves_the_files_there_as_they_were(reg, tmp_path):
    """The version's files are renamed into place together, once all are written and checked: a
    pull of v2 over v1 whose last big file meets a damaged chunk leaves v1's files, every one, and
    no temp file beside them (before, the files written before it had been renamed over v1's); one
    into a new folder leaves no folder."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.errors import IntegrityError

    v1, v2 = synth.two_directory_versions(tmp_path / "src")
    reg.push(v1, "fam", "v1")
    reg.push(v2, "fam", "v2", parent="v1")
    out = tmp_path / "engine"
    reg.pull("fam", "v1", out)
    path, victim = synth.last_file_victim(reg.manifest("fam", "v1")[1], reg.manifest("fam", "v2")[1])
    stored = reg.locate([victim])[victim]
    pack = reg.blobs.root / pack_key(stored.pack_id)
    pack.chmod(0o644)
    data = bytearray(pack.read_bytes())
    data[stored.offset + stored.stored_size // 2] ^= 0x40
    pack.write_bytes(data)

    with pytest.raises(IntegrityError, match=victim):
        reg.pull("fam", "v2", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in v1.iterdir())  # no temp file stayed
    for f in v1.iterdir():
        assert filecmp.cmp(out / f.name, f, shallow=False), f.name
    with pytest.raises(IntegrityError, match=victim):  # into a new folder: the folders it made go again
        reg.pull("fam", "v2", tmp_path / "new" / "engine")
    assert not (tmp_path / "new").exists()


@sqlite_only
@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_push_that_finds_its_stored_chunks_pack_lost_sends_them_again_and_mends_the_store(
    store, settings, fam, tmp_path, request
):
    """A pack deleted from the blob store by hand: a push of a version that reuses its chunks sent
    nothing, committed, and the version could not be pulled. It now finds the pack gone (one
    size lookup per pack), stores those chunks again, points their rows at the new copies and
    commits a version that pulls byte for byte; the earlier version that lost them pulls again too."""
    from dataclasses import replace

    from mfsreg.registry.blobs.packs import pack_key

    if store == "s3":
        blob_url, endpoint = request.getfixturevalue("s3_blob_url")
        settings = replace(settings, blob_url=blob_url, s3_endpoint_url=endpoint)
    with Registry(settings, migrate=True) as reg:
        reg.push(fam["base"], "fam", "base")
        _, manifest = reg.manifest("fam", "base")
        packs = sorted({c.pack_id for c in reg.locate(manifest.chunk_ids()).values()})
        reg.blobs.delete(pack_key(packs[0]))
        with pytest.raises(StorageError, match=f"storage lost data .*{packs[0]}"):
            reg.pull("fam", "base", tmp_path / "broken.out")
        res = reg.push(fam["base"], "fam", "again")
        assert res.new_chunks > 0 and res.new_bytes > 0 and res.mended_chunks == res.new_chunks, res
        for name in ("again", "base"):
            reg.pull("fam", name, tmp_path / f"{name}.out")
            assert filecmp.cmp(tmp_path / f"{name}.out", fam["base"], shallow=False), name
        assert packs[0] not in {c.pack_id for c in reg.locate(manifest.chunk_ids()).values()}
        # and the next push finds everything whole: nothing sent
        assert reg.push(fam["base"], "fam", "third").new_chunks == 0


@sqlite_only
@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_repush_of_an_existing_version_mends_what_its_lost_pack_held(store, settings, fam, tmp_path, request):
    """A version that cannot be pulled because a pack was deleted from the blob store by hand: pushing
    its file again under its own name answered 'already stored' and mended nothing. It now stores
    again the chunks that lay there (and those leaning on them down a delta chain), plain, points
    their rows at the new copies and reports them (existed, mended_chunks); the version pulls byte for
    byte. A re-push with nothing lost stores nothing, and other content under the name is refused."""
    from dataclasses import replace

    from mfsreg.registry.blobs.packs import pack_key

    if store == "s3":
        blob_url, endpoint = request.getfixturevalue("s3_blob_url")
        settings = replace(settings, blob_url=blob_url, s3_endpoint_url=endpoint)
    with Registry(settings, migrate=True) as reg:
        reg.push(fam["base"], "fam", "base")
        reg.push(fam["full-med"], "fam", "med", parent="base")  # deltas against base's chunks
        assert reg.push(fam["base"], "fam", "base").new_bytes == 0  # nothing lost: nothing stored
        base_ids = reg.manifest("fam", "base")[1].chunk_ids()
        med = reg.manifest("fam", "med")[1].chunk_ids()
        leaning = {i for i, c in reg.locate(med).items() if i in med and c.basis_id in base_ids}
        assert leaning
        packs = sorted({c.pack_id for i, c in reg.locate(base_ids).items() if i in base_ids})
        for p in packs:
            reg.blobs.delete(pack_key(p))
        for name in ("base", "med"):
            with pytest.raises(StorageError, match="storage lost data"):
                reg.pull("fam", name, tmp_path / f"{name}.broken")
        with pytest.raises(Conflict, match="already exists with other content"):
            reg.push(fam["lora-chat"], "fam", "base")  # refused as before, mending nothing

        res = reg.push(fam["full-med"], "fam", "med", parent="base")  # its chunks leaning on lost ones
        assert res.existed and res.mended_chunks >= len(leaning) and res.new_bytes > 0, res
        assert res.new_chunks == res.mended_chunks and res.reused_chunks == res.chunks - res.mended_chunks
        reg.pull("fam", "med", tmp_path / "med.out")
        assert filecmp.cmp(tmp_path / "med.out", fam["full-med"], shallow=False)
        located = reg.locate(med)
        assert not {c.pack_id for c in located.values()} & set(packs)

        res = reg.push(fam["base"], "fam", "base")
        assert res.existed and res.mended_chunks > 0 and res.new_bytes > 0, res
        reg.pull("fam", "base", tmp_path / "base.out")
        assert filecmp.cmp(tmp_path / "base.out", fam["base"], shallow=False)
        again = reg.push(fam["base"], "fam", "base")
        assert again.existed and again.mended_chunks == 0 and again.new_bytes == 0 and again.new_chunks == 0
        assert reg.versions("fam")[0].digest == res.digest and len(reg.versions("fam")) == 2


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@sqlite_only
def test_a_pull_over_a_file_keeps_that_files_mode(reg, fam, tmp_path):
    """A pull builds each file under a temp name and renames it over the one at its place: a file
    made read-only (0444) came back 0644, its protection gone without a word. The new file takes
    the permission bits of the file it replaces, as cp's does; a file new there gets the umask's."""
    reg.push(fam["base"], "fam", "base")
    out = tmp_path / "out.safetensors"
    reg.pull("fam", "base", out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~_umask()
    for kept in (0o444, 0o640):
        out.chmod(kept)
        reg.pull("fam", "base", out)
        assert stat.S_IMODE(out.stat().st_mode) == kept and filecmp.cmp(out, fam["base"], shallow=False)
    src = tmp_path / "ckpt"  # a directory version: each file its own
    src.mkdir()
    synth.sharded_dir(src, synth.base_tensors())
    reg.push(src, "fam", "sharded")
    pulled = tmp_path / "pulled"
    reg.pull("fam", "sharded", pulled)
    (pulled / "config.json").chmod(0o400)
    shard = pulled / "model-00001-of-00002.safetensors"
    shard.chmod(0o444)
    reg.pull("fam", "sharded", pulled)
    assert stat.S_IMODE((pulled / "config.json").stat().st_mode) == 0o400
    assert stat.S_IMODE(shard.stat().st_mode) == 0o444
    assert stat.S_IMODE((pulled / "tokenizer.json").stat().st_mode) == 0o666 & ~_umask()
    assert filecmp.cmp(shard, src / shard.name, shallow=False)


def test_a_download_answer_goes_in_pieces_of_whole_payloads_that_parse_back(reg, fam, monkeypatch):
    """The server sends a download's payloads joined into pieces of at least STREAM_PIECE bytes
    (each piece it sends costs a hop to a worker thread and every middleware's send), the last
    piece holding what is left: the pieces, parsed as the node parses a stream, give every payload
    as stored, in order."""
    from mfsreg.registry.blobs.packs import read_payloads
    from mfsreg.registry.format.wire import read_stream
    from mfsreg.registry.store import service

    monkeypatch.setattr(service, "STREAM_PIECE", 100_000)  # the test family's 0.7 MB in several pieces
    reg.push(fam["base"], "fam", "base")
    ids = reg.manifest("fam", "base")[1].chunk_ids()
    chunks = service.plan_download(reg, "fam", ids)
    stored = {c.id: bytes(p) for c, p in read_payloads(reg.blobs, chunks)}
    assert len(chunks) > 4 and sum(map(len, stored.values())) > 2 * service.STREAM_PIECE
    pieces = list(service.stream_chunks(reg, chunks))
    got = [(e.id, payload) for e, payload in read_stream(iter(pieces))]
    assert got == [(c.id, stored[c.id]) for c in chunks]
    # where each payload ends in the stream (after the index, which the first piece starts with)
    index = len(b"".join(pieces)) - sum(len(p) for _, p in got)
    ends = [index]
    for _, p in got:
        ends.append(ends[-1] + len(p))
    cuts = [sum(len(p) for p in pieces[: k + 1]) for k in range(len(pieces))]
    assert set(cuts) <= set(ends), "a piece ends inside a payload"
    starts = [0, *cuts[:-1]]
    for k, (start, cut) in enumerate(zip(starts, cuts)):
        if k < len(pieces) - 1:
            assert cut - start >= service.STREAM_PIECE, (k, cut - start)
        # no piece holds a payload more than it needs: without its last one it was short of the size
        before = max(e for e in ends if e < cut)
        assert before - start < service.STREAM_PIECE or before <= start, (k, before - start)
