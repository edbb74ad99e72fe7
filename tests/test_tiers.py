"""Tiers: base / group / unique, rebalanced incrementally on push and delete."""

from __future__ import annotations

from collections import Counter

import pytest

from mfsreg.registry.store.tiers import BASE, GROUP, UNIQUE, threshold, tier_of
from tests import synth


def expected_tiers(reg, family: str, quorum: float = 1.0) -> dict[str, tuple[str, int]]:
    """Tiers recomputed from scratch from every member's manifest (what incremental must equal).
    A member uses its chunks and, to rebuild them, the bases of its deltas."""
    members = reg.versions(family)
    users = Counter()
    for v in members:
        _, m = reg.manifest(family, v.name)
        users.update(reg.locate(m.chunk_ids()).keys())
    return {c: (tier_of(n, len(members), quorum), n) for c, n in users.items()}


def test_threshold_policy():
    assert threshold(1, 1.0) == 1 and threshold(5, 1.0) == 5
    assert threshold(10, 0.3) == 3 and threshold(3, 0.5) == 2
    assert tier_of(5, 5, 1.0) == BASE and tier_of(4, 5, 1.0) == GROUP and tier_of(1, 5, 1.0) == UNIQUE
    assert tier_of(3, 10, 0.3) == BASE


def test_tiers_add_up_to_stored_bytes_and_match_recompute(reg, fam):
    for name, p in fam.items():
        reg.push(p, "fam", name)
        assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")
        if name == "last-code":  # before the full fine-tune, the untouched tensors are base
            assert reg.stats("fam")["tiers"][BASE]["chunks"] > 0
    s = reg.stats("fam")
    assert sum(t["bytes"] for t in s["tiers"].values()) == s["stored_bytes"] > 0
    # a full fine-tune shares no exact chunk with the others, but it is stored as deltas whose bases
    # are the base's chunks: it needs them to rebuild, so none of them is unique to the base. Those
    # of tensors no other member changed stay in base; those of layers last-code retrained (and
    # stores plain) are used by the base and full-med, not by last-code: group
    _, full = reg.manifest("fam", "full-med")
    located = reg.locate(full.chunk_ids())
    deltas = [c for c in located.values() if c.basis_id]
    assert len(deltas) > len(full.chunk_ids()) // 2
    tiers = reg.chunk_tiers("fam")
    assert BASE in {tiers[c.basis_id][0] for c in deltas} <= {BASE, GROUP}
    assert {tiers[c.id][0] for c in deltas} == {UNIQUE}
    assert s["tiers"][UNIQUE]["chunks"] > 0
    whole = reg.stats()
    assert sum(t["bytes"] for t in whole["tiers"].values()) == whole["stored_bytes"] == s["stored_bytes"]
    assert whole["sharing_ratio"] == pytest.approx(whole["logical_bytes"] / whole["stored_bytes"], rel=1e-3)
    # what each version alone holds is exactly its unique-tier chunks
    unique = s["tiers"][UNIQUE]["bytes"]
    assert sum(v["unique_bytes"] for v in s["versions"]) == unique


def test_unique_bytes_are_what_deleting_a_version_frees_across_families(reg, fam):
    """Chunks are stored once for the whole registry: a member pushed into two families is
    neither family's own, so deleting it from one frees nothing, and its unique_bytes say 0;
    deleting it from the other frees what that one then said it alone holds."""
    reg.push(fam["base"], "a", "base")
    reg.push(fam["lora-chat"], "a", "chat")
    reg.push(fam["lora-chat"], "b", "chat")
    per = {(v["family"], v["version"]): v["unique_bytes"] for v in reg.stats()["versions"]}
    assert per[("a", "chat")] == per[("b", "chat")] == 0
    assert per[("a", "base")] > 0  # the base's chunks the LoRA member does not use are a's alone
    reg.delete("a", "chat")
    assert reg.stats()["unreferenced_bytes"] == 0
    alone = {(v["family"], v["version"]): v["unique_bytes"] for v in reg.stats()["versions"]}[("b", "chat")]
    assert alone > 0  # now b's chat holds its LoRA chunks alone
    reg.delete("b", "chat")
    assert reg.stats()["unreferenced_bytes"] == alone


def test_drift_moves_only_affected_chunks_out_of_base(reg, tmp_path):
    base = synth.base_tensors()
    paths = {
        "base": synth.write(tmp_path / "base.safetensors", base),
        "chat": synth.write(tmp_path / "chat.safetensors", synth.lora(base, seed=11)),
        "code": synth.write(tmp_path / "code.safetensors", synth.lora(base, seed=12)),
        "drift": synth.write(tmp_path / "drift.safetensors", synth.lora(synth.extend_vocab(base), seed=13)),
    }
    for name in ("base", "chat", "code"):
        reg.push(paths[name], "fam", name)
    base_before = set(reg.chunk_tiers("fam", BASE))
    assert len(base_before) > 10
    res = reg.push(paths["drift"], "fam", "drift")
    base_after = set(reg.chunk_tiers("fam", BASE))
    _, drift = reg.manifest("fam", "drift")
    needs = set(reg.locate(drift.chunk_ids()))  # its chunks and the bases of its deltas
    left = base_before - base_after
    # exactly the base chunks the drifted member does not need left base...
    assert left == base_before - needs
    # ...which are only its header and the tails of the two vocabulary tensors (a tail that changed
    # size is stored as a delta against the old tail when that is smaller, and then stays needed)
    _, b = reg.manifest("fam", "base")
    f = b.files[0]
    tails = {
        [c.id for c in f.chunks if t.start <= c.offset < t.end][-1]
        for t in f.tensors
        if t.name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    assert f.chunks[0].id in left and left <= tails | {f.chunks[0].id}
    assert base_after == base_before - left
    # the rebalance touched the chunks that changed tier, not every chunk of the family
    assert res.tier_changes == len(left)
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")


def test_delete_rebalances(reg, fam):
    for name in ("base", "lora-chat", "last-code"):
        reg.push(fam[name], "fam", name)
    reg.delete("fam", "last-code")
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")
    reg.delete("fam", "base")
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")
    assert set(t for t, _ in reg.chunk_tiers("fam").values()) == {BASE}  # one member: all of it is base


def test_base_quorum(reg, fam):
    # chat's LoRA chunks are used by two of four members: group under quorum 1.0, base under 0.5
    for name, p in (
        ("base", fam["base"]),
        ("chat", fam["lora-chat"]),
        ("chat-copy", fam["lora-chat"]),
        ("code", fam["last-code"]),
    ):
        reg.push(p, "fam", name)
    before = reg.stats("fam")["tiers"]
    assert before[GROUP]["chunks"] > 0
    changed = reg.set_base_quorum("fam", 0.5)
    assert changed == before[GROUP]["chunks"]
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam", 0.5)
    after = reg.stats("fam")["tiers"]
    assert after[BASE]["chunks"] == before[BASE]["chunks"] + before[GROUP]["chunks"] and after[GROUP]["chunks"] == 0
    # incremental rebalancing keeps honouring the quorum
    reg.push(fam["vocab-ext"], "fam", "vocab")
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam", 0.5)
    reg.delete("fam", "code")
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam", 0.5)


def test_every_change_to_a_family_bumps_its_epoch(reg, fam):
    """The epoch tags a family's version documents (service.version_doc): each commit, delete and
    quorum change moves it, and nothing else (a read, a re-push of an existing version) does."""
    from sqlalchemy import select

    from mfsreg.registry.db.engine import read_tx
    from mfsreg.registry.db.models import families
    from mfsreg.registry.store import service

    def epoch() -> int:
        with read_tx(reg.engine) as conn:
            return conn.execute(select(families.c.epoch).where(families.c.name == "fam")).scalar_one()

    seen = []
    reg.push(fam["base"], "fam", "base")
    seen.append(epoch())
    reg.push(fam["lora-chat"], "fam", "lora-chat")
    seen.append(epoch())
    reg.push(fam["lora-chat"], "fam", "lora-chat")  # exists: nothing changes
    service.version_doc(reg, "fam", "base")
    assert epoch() == seen[-1]
    reg.set_base_quorum("fam", 0.5)
    seen.append(epoch())
    reg.delete("fam", "lora-chat")
    seen.append(epoch())
    assert seen == sorted(set(seen)), seen  # strictly rising
    doc, tag = service.version_doc(reg, "fam", "base")
    assert doc is not None and service.version_doc(reg, "fam", "base", if_none_match=tag) == (None, tag)
    assert service.version_doc(reg, "fam", "base", if_none_match=f'W/"x", {tag}')[0] is None


def test_a_kept_version_document_follows_every_change_to_its_family(reg, fam):
    """The server keeps a document's manifest and chunk table by tag (service.version_doc): what it
    answers after a change equals what a registry that kept nothing answers, and it keeps a few."""
    from mfsreg.registry.context import Kept
    from mfsreg.registry.registry import Registry
    from mfsreg.registry.store import service

    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "lora-chat")
    before, tag = service.version_doc(reg, "fam", "lora-chat")
    assert reg.documents.get(tag) is not None
    assert service.version_doc(reg, "fam", "lora-chat") == (before, tag)  # from what was kept
    reg.set_base_quorum("fam", 0.5)  # lora-chat's own chunks join base: the tiers in its table move
    after, moved = service.version_doc(reg, "fam", "lora-chat")
    other = Registry(reg.settings)
    try:
        assert moved != tag and after != before
        assert (after, moved) == service.version_doc(other, "fam", "lora-chat")
    finally:
        other.close()
    kept = Kept(2)
    for k in "abc":
        kept.put(k, k.upper())
    assert kept.get("a") is None and kept.get("b") == "B"
    kept.put("d", "D")  # b was read last: c goes
    assert (kept.get("b"), kept.get("c"), kept.get("d")) == ("B", None, "D")


def test_a_version_pushed_again_under_its_name_never_keeps_its_tag(reg, fam):
    """Even when the writer bumps no epoch (one of an earlier release: here the epoch is put back
    as it would leave it) and SQLite gives the new row the deleted one's id."""
    from sqlalchemy import update

    from mfsreg.registry.db import versions as version_db
    from mfsreg.registry.db.engine import read_tx, write_tx
    from mfsreg.registry.db.models import families
    from mfsreg.registry.store import service

    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "v")
    doc, tag = service.version_doc(reg, "fam", "v")
    with read_tx(reg.engine) as conn:
        old, epoch = version_db.find_version_and_epoch(conn, "fam", "v")
    reg.delete("fam", "v")
    reg.push(fam["last-code"], "fam", "v")
    with write_tx(reg.engine) as conn:
        conn.execute(update(families).where(families.c.name == "fam").values(epoch=epoch))
        new_id = version_db.find_version(conn, "fam", "v").id
    if reg.engine.dialect.name == "sqlite":
        assert new_id == old.id  # the case this guards: the same id, the same epoch
    new_doc, new_tag = service.version_doc(reg, "fam", "v", if_none_match=tag)
    assert new_doc is not None and new_tag != tag and new_doc["digest"] != doc["digest"]
