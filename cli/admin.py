"""Admin commands: `db upgrade`, `family quorum` and `check` (where the metadata database is), `prune`."""

from __future__ import annotations

import typer
from typer.core import TyperCommand

from mfsreg.cli.backend import RegistryOption, embedded, local_only, open_backend
from mfsreg.cli.bars import progress_for
from mfsreg.cli.exits import usage_error_type
from mfsreg.cli.output import emit_json, human_bytes

db_app = typer.Typer(help="The metadata database.", no_args_is_help=True)
family_app = typer.Typer(help="Family settings.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade(json_: bool = typer.Option(False, "--json")) -> None:
    """Apply pending schema migrations to MFSREG_DATABASE_URL (or the embedded database)."""
    from mfsreg.registry.registry import upgrade_database

    local_only("db upgrade")

    rev = upgrade_database()
    if json_:
        emit_json({"revision": rev})
    else:
        typer.echo(f"database schema at revision {rev}")


class NumbersNotOptions(TyperCommand):
    """A command whose arguments may be negative numbers: click would read ``-0.1`` as an unknown
    option (``ignore_unknown_options`` keeps it an argument, for the range check to refuse). An
    unknown option that is not a number is refused here, before click parses anything, so that it
    is named as click names one, wherever it stands, even before a missing argument."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        from mfsreg.registry.errors import shown

        known = {opt for param in self.get_params(ctx) for opt in (*param.opts, *param.secondary_opts)}
        for word in args:
            if word == "--":  # what follows is arguments, as click reads it
                break
            name = word.partition("=")[0]
            if word.startswith("-") and word != "-" and name not in known and _number(word) is None:
                raise usage_error_type()(f"No such option: {shown(name, 60)[1:-1]}", ctx=ctx)
        return super().parse_args(ctx, args)


@family_app.command("quorum", cls=NumbersNotOptions, context_settings={"ignore_unknown_options": True})
def quorum(
    family: str = typer.Argument(...),
    value: str = typer.Argument(..., help="Fraction of members that must use a chunk for it to be base, in (0, 1]."),
    json_: bool = typer.Option(False, "--json"),
) -> None:
    """Set a family's base quorum and re-tier its chunks."""
    from mfsreg.registry.errors import shown

    if (fraction := _number(value)) is None:
        raise typer.BadParameter(
            f"{shown(value, 40)} is not a number: give a fraction in (0, 1], e.g. 0.5", param_hint="'value'"
        )
    local_only("family quorum")

    with embedded(blobs=False) as reg:  # re-tiering reads and writes only the database
        changed = reg.set_base_quorum(family, fraction)
    if json_:
        emit_json({"family": family, "base_quorum": fraction, "tier_changes": changed})
    else:
        typer.echo(f"{family}: base quorum {fraction}; {changed} chunks changed tier")


def _number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def prune(
    min_age: str = typer.Option(
        "1h",
        "--min-age",
        help="Grace period: chunks recorded, and packs retired or announced, more recently than "
        "this stay (a push may not have committed yet; a pull may still read a retired pack). 0 when nothing else runs.",
    ),
    max_unused: float = typer.Option(
        0.1, "--max-unused", help="Repack a pack when more than this share of it is unused."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be deleted and freed."),
    json_: bool = typer.Option(False, "--json"),
    registry: str = RegistryOption,
) -> None:
    """Delete the chunks no version needs and give back their space: packs left empty are deleted,
    packs mostly unused are repacked, and parts of packs that killed writers left are removed.
    Chunks that deltas of stored versions need are kept. With MFSREG_URL the server prunes its
    registry (an admin token for every family)."""
    from mfsreg.registry.config import parse_duration
    from mfsreg.registry.errors import InvalidRequest

    try:
        seconds = parse_duration(min_age)
    except ValueError:
        raise InvalidRequest(f"--min-age {min_age!r}: give seconds, or a number with s, m, h or d (e.g. 1h)") from None
    with open_backend(registry) as reg, progress_for(json_) as progress:
        res = reg.prune(seconds, max_unused, dry_run, progress)
    if json_:
        emit_json(res.to_dict())
        return

    chunks = f"{_n(res.deleted_chunks, 'chunk')} no version needs ({human_bytes(res.deleted_chunk_bytes)})"
    packs = f"{_n(res.repacked_packs, 'pack')} ({human_bytes(res.moved_bytes)}"
    blobs = f"{_n(res.deleted_packs, 'pack blob')}, freeing {human_bytes(res.freed_bytes)}"
    if dry_run:
        head = f"would delete {chunks}; would repack {packs} to move); would delete {blobs}"
    else:
        head = f"deleted {chunks}; repacked {packs} moved); deleted {blobs}"
    typer.echo(head)
    if res.waiting_packs:
        typer.echo(
            f"{_n(res.waiting_packs, 'unlisted pack')} ({human_bytes(res.waiting_bytes)}: retired, or being written) "
            f"wait out --min-age {min_age}; a later prune deletes those no push records"
        )


def check(
    family: str = typer.Option(None, "--family", "-f", help="One family; without it, the whole registry."),
    read_data: bool = typer.Option(
        False,
        "--read-data",
        help="Also read every chunk, decode it and hash it against "
        "its id (reads all the stored bytes; without it, each pack is only looked up).",
    ),
    json_: bool = typer.Option(False, "--json", help="Print one JSON object."),
    registry: str = RegistryOption,
) -> None:
    """Check that the blob store holds every byte the stored versions need; name what is lost or
    damaged and the versions that cannot be pulled because of it. Changes nothing; exits 4 when
    something is wrong. With MFSREG_URL the server checks its store (an admin token: for the
    family, or for every family)."""
    with open_backend(registry) as reg, progress_for(json_) as progress:
        res = reg.check(family, read_data, progress)
    if json_:
        emit_json(res.to_dict())
    else:
        _say_checked(res, read_data)
    if not res.ok:
        raise typer.Exit(4)


def _say_checked(res, read_data: bool) -> None:
    scope = "the registry" if res.scope == "registry" else res.scope
    head = (
        f"checked {_n(res.versions, 'version')} of {scope}: {_n(res.chunks, 'chunk')} in {_n(res.packs, 'pack')} "
        f"({human_bytes(res.stored_bytes)} stored)"
    )
    if res.ok:
        typer.echo(
            f"{head}, "
            + (
                "every chunk read and verified: all intact"
                if read_data
                else "every pack present and whole (--read-data also reads and verifies each chunk)"
            )
        )
        return
    problems = [_n(len(res.lost_packs), "pack") + " lost"] if res.lost_packs else []
    if res.damaged_chunks:
        problems.append(_n(len(res.damaged_chunks), "chunk") + " damaged")
    if res.unrecorded_chunks:
        problems.append(_n(res.unrecorded_chunks, "chunk") + " the versions need missing from the database")
    typer.echo(f"{head}: {', '.join(problems)}; {_n(len(res.broken_versions), 'version')} cannot be pulled")
    shown = 10
    lines = [f"pack {p}: {why}" for p, why in res.lost_packs.items()]
    lines += [f"pack {p}: {_n(d['chunks'], 'chunk')} damaged ({d['first']})" for p, d in res.damaged_packs.items()]
    lines += [f"cannot be pulled: {v}" for v in res.broken_versions]
    for line in lines[: 3 * shown]:
        typer.echo(f"  {line}")
    if len(lines) > 3 * shown:
        typer.echo(f"  ... and {len(lines) - 3 * shown} more (--json lists them all)")
    if res.lost_packs:
        typer.echo(
            "restore the lost packs from a backup (and check that MFSREG_BLOB_URL names this registry's store), "
            "or push each listed version's file again: a push stores anew the chunks of lost packs it holds"
        )
    if res.damaged_packs:
        typer.echo(
            "restore the damaged packs from a backup, or push each listed version's file again with "
            "--mend-damaged: the push reads the version's stored chunks and stores again those that are damaged"
        )
    if res.unrecorded_chunks:
        typer.echo(
            "the database lost the rows of chunks its versions need: restore it from a backup (with the blob "
            "store of the same time)"
        )


def _n(count: int, what: str) -> str:
    """ "1 pack", "2 packs"."""
    return f"{count} {what}{'' if count == 1 else 's'}"


def audit(
    limit: int = typer.Option(100, "--limit", "-n", help="The newest entries, at most this many."),
    json_: bool = typer.Option(False, "--json", help="Print one JSON object."),
    registry: str = RegistryOption,
) -> None:
    """Who deleted, pruned, changed a quorum or a token, and when (newest first; admins)."""
    from mfsreg.registry.errors import InvalidRequest
    from mfsreg.registry.results import timestamp

    if not 1 <= limit <= 10_000:
        raise InvalidRequest(f"--limit {limit}: give 1 to 10000")
    with open_backend(registry, blobs=False) as reg:
        rows = [
            dict(at=timestamp(r.at), actor=r.actor, action=r.action, family=r.family, detail=r.detail)
            for r in reg.audit(limit=limit)
        ]
    if json_:
        emit_json({"entries": rows})
        return
    from mfsreg.cli.output import table

    table(
        None,
        ["when", "who", "action", "family", "detail"],
        [[r["at"][:19].replace("T", " "), r["actor"], r["action"], r["family"] or "-", r["detail"]] for r in rows],
        names=4,
    )
