"""`mfsreg cache ...`: the node cache of an inference node (MFSREG_CACHE_DIR)."""

from __future__ import annotations

import typer

from mfsreg.cli.backend import ServerOption
from mfsreg.cli.output import emit_json, human_bytes, table

cache_app = typer.Typer(
    help="The node cache (MFSREG_CACHE_DIR, default $XDG_CACHE_HOME/mfsreg, else ~/.cache/mfsreg).",
    no_args_is_help=True,
)


@cache_app.command("warm")
def warm(
    family: str = typer.Argument(...),
    tier: str = typer.Option("base", "--tier", help="base, group or unique: the family's chunks of this tier."),
    recent: int = typer.Option(0, "--recent", help="Also keep the chunks of the N most recently pulled members warm."),
    pin: bool = typer.Option(True, "--pin/--no-pin", help="Pin the family's base tier so eviction never drops it."),
    json_: bool = typer.Option(False, "--json"),
    registry: str = ServerOption,
) -> None:
    """Fetch a family's tier (and recent members) into the cache ahead of time."""
    from mfsreg.registry.client.warm import warm_cache

    result = warm_cache(_remote(registry), family, tier, recent, pin)
    if json_:
        emit_json(result)
    else:
        typer.echo(f"{family}: {result['chunks']} chunks warm, {human_bytes(result['fetched_bytes'])} fetched")


@cache_app.command("unpin")
def unpin(family: str = typer.Argument(...), json_: bool = typer.Option(False, "--json")) -> None:
    """Let eviction drop a family's base tier again (undoes the pin of `cache warm`); nothing is deleted now."""
    from mfsreg.registry.client.cache import NodeCache, missing_cache_stats
    from mfsreg.registry.errors import InvalidRequest
    from mfsreg.registry.names import check_name

    check_name("family", family)
    if missing_cache_stats() is not None:  # no cache there: nothing pinned, and none made
        raise InvalidRequest(f"family {family!r} is not pinned in this cache (pinned: none)")
    cache = NodeCache()
    try:
        pinned = cache.pinned()
        if family not in pinned:
            raise InvalidRequest(
                f"family {family!r} is not pinned in this cache (pinned: {', '.join(pinned) or 'none'})"
            )
        cache.unpin(family)
        pinned.remove(family)
    finally:
        cache.close()
    if json_:
        emit_json({"family": family, "pinned_families": pinned})
    else:
        typer.echo(
            f"{family}: unpinned; its base tier is evicted like any other chunks (`mfsreg cache prune` to shrink now)"
        )


@cache_app.command("stats")
def stats(json_: bool = typer.Option(False, "--json")) -> None:
    """What the cache holds, by tier."""
    from mfsreg.registry.client.cache import NodeCache, missing_cache_stats

    s = missing_cache_stats()
    if s is not None and not json_:
        typer.echo(f"{s['path']}: no cache there yet (a pull or `mfsreg cache warm` makes it)")
        return
    if s is None:
        cache = NodeCache()
        try:
            s = cache.stats()
        finally:
            cache.close()
    if json_:
        emit_json(s)
        return
    typer.echo(f"{s['path']}: {s['chunks']} chunks, {human_bytes(s['bytes'])} (limit {human_bytes(s['max_bytes'])})")
    table(
        None,
        ["tier", "entries", "bytes"],
        [[t, v["entries"], human_bytes(v["bytes"])] for t, v in s["by_tier"].items()],
    )


@cache_app.command("prune", short_help="Evict down to the size limit, and remove temp files that killed writers left.")
def prune(
    max_size: str = typer.Option(None, "--max-size", help="Shrink to this size (e.g. 20G); default MFSREG_CACHE_MAX."),
    json_: bool = typer.Option(False, "--json"),
) -> None:
    """Evict files, then unique, group and base chunks (least recently used first) down to the limit,
    and remove temp files that killed writers left (older than an hour). Files a killed writer left
    unrecorded are counted (and evictable) from here on."""
    from mfsreg.registry.client.cache import NodeCache, default_max_bytes, missing_cache_stats
    from mfsreg.registry.config import SIZE_HINT, parse_size
    from mfsreg.registry.errors import InvalidRequest

    try:
        limit = parse_size(max_size) if max_size else default_max_bytes()
    except (ValueError, OverflowError):
        raise InvalidRequest(f"--max-size {max_size!r} is not a size: {SIZE_HINT}") from None
    if (none := missing_cache_stats()) is not None:  # a mistyped MFSREG_CACHE_DIR stays as it was
        if json_:
            emit_json(
                {
                    "removed": 0,
                    "freed_bytes": 0,
                    "bytes": 0,
                    "temp_files_removed": 0,
                    "unrecorded_files_found": 0,
                    "in_use_bytes": 0,
                }
            )
        else:
            typer.echo(f"{none['path']}: no cache there yet, nothing to prune")
        return
    cache = NodeCache()  # a damaged index is reported first, whatever the limit
    if limit is None:
        raise InvalidRequest("no limit to prune to: give --max-size or set MFSREG_CACHE_MAX")
    orphans = cache.record_orphans()
    removed, freed = cache.evict(limit)
    temps = cache.sweep_temps()
    total = cache.total_bytes()
    # what pulls, loads and switches running now lease stays (eviction.py): said where it kept the cache over
    in_use = cache.leased_bytes() if total > limit else 0
    if json_:
        emit_json(
            {
                "removed": removed,
                "freed_bytes": freed,
                "bytes": total,
                "temp_files_removed": temps,
                "unrecorded_files_found": orphans,
                "in_use_bytes": in_use,
            }
        )
    else:
        typer.echo(
            f"removed {removed} entries, freed {human_bytes(freed)}"
            + (f", and {temps} temp files left by killed writers" if temps else "")
            + (
                f"; {human_bytes(in_use)} in use by running pulls, loads or switches stays until they end"
                if in_use
                else ""
            )
        )


@cache_app.command("verify", short_help="Hash every cached chunk and file against its name; drop what is damaged.")
def verify(json_: bool = typer.Option(False, "--json")) -> None:
    """Hash every cached chunk and materialised file against its name; drop what is damaged
    (it is fetched again when next needed). Exits 4, the code of integrity errors, when it dropped
    something: the cache is whole again, but a script should hear that this node's disk lost bytes."""
    from mfsreg.cli.bars import progress_for
    from mfsreg.registry.client.cache import NodeCache, missing_cache_stats
    from mfsreg.registry.client.scrub import verify_cache

    if (none := missing_cache_stats()) is not None:  # a mistyped MFSREG_CACHE_DIR stays as it was
        if json_:
            emit_json(
                {
                    "chunks": 0,
                    "files": 0,
                    "bytes": 0,
                    "damaged_chunks": [],
                    "damaged_files": [],
                    "damaged_dirs": [],
                    "unrecorded_files_found": 0,
                }
            )
        else:
            typer.echo(f"{none['path']}: no cache there yet, nothing to verify")
        return
    cache = NodeCache()
    with progress_for(json_) as progress:
        result = verify_cache(cache, progress)
    damaged = len(result["damaged_chunks"]) + len(result["damaged_files"]) + len(result["damaged_dirs"])
    if json_:
        emit_json(result)
    else:
        typer.echo(
            f"checked {result['chunks']} chunks and {result['files']} files ({human_bytes(result['bytes'])}): "
            + (
                f"{damaged} damaged and dropped (fetched again when next needed); check this node's disk"
                if damaged
                else "all intact"
            )
        )
    if damaged:
        raise typer.Exit(4)


def _remote(registry: str | None):
    from mfsreg.cli.backend import server_client
    from mfsreg.registry.errors import InvalidRequest

    if not registry:
        raise InvalidRequest("the node cache serves a remote registry: set MFSREG_URL or pass --registry")
    return server_client(registry)
