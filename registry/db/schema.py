"""Schema upgrades through Alembic: the only way the schema changes.

``upgrade`` runs the migrations to head (``mfsreg db upgrade``). ``ensure_current`` is called on
open: the embedded default upgrades itself on first use; a server database that lags behind is an
error that names the command to run, since upgrading a shared database is an operator's decision.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

from mfsreg.registry.db.locks import lock_file, session_lock
from mfsreg.registry.errors import StorageError

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def known_revisions() -> list[str]:
    """The revisions this code ships, oldest first, read from the names of migrations/versions/
    (NNNN_what.py holds revision NNNN, down from NNNN-1; tests/test_migrations.py checks this
    against Alembic). Cheap: a command that finds its database current never imports Alembic."""
    names = (p.name for p in (MIGRATIONS / "versions").iterdir())
    return sorted(n[:4] for n in names if n.endswith(".py") and n[:4].isdigit())


def _stamped_revision(engine: Engine) -> str | None:
    """The revision recorded in alembic_version, read with plain SQL; None where there is none."""
    with engine.connect() as conn:
        try:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except DBAPIError:  # no such table: a database never migrated
            conn.rollback()
            return None


def _config(engine: Engine) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision(engine: Engine) -> str:
    from alembic.script import ScriptDirectory

    return _head(ScriptDirectory.from_config(_config(engine)))


def _head(script: ScriptDirectory) -> str:
    head = script.get_current_head()
    if head is None:  # Alembic's answer for no migrations at all: an install that lost migrations/versions/
        raise StorageError(f"no schema migrations in {MIGRATIONS / 'versions'}: reinstall mfsreg")
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> str:
    """Apply every pending migration; returns the revision now in force. Processes that upgrade
    one database at once take turns (two API processes starting, `db upgrade` beside an embedded
    command): the second finds the work done. A migration that fails leaves the database at the
    revision before it (each runs in a transaction of its own) and is one line naming it."""
    with _migration_lock(engine):
        current = current_revision(engine)
        head = _known(engine, current)
        if current == head:
            return head
        from alembic import command

        try:
            command.upgrade(_config(engine), "head")
        except OperationalError:
            raise  # the database itself (unreachable, locked, full): the caller says which
        except Exception as exc:  # a migration's own error: which one failed, and where the database stays
            first = (str(getattr(exc, "orig", None) or exc).splitlines() or [""])[0]
            stays = current_revision(engine)
            failed = _next_revision(engine, stays)
            raise StorageError(
                f"schema migration {failed} failed ({type(exc).__name__}: {first}); the database "
                f"stays at revision {stays or 'none'}, with the migrations before it: set "
                "MFSREG_DEBUG=1 for the traceback and tell mfsreg's developers"
            ) from exc
    return head


def _next_revision(engine: Engine, current: str | None) -> str:
    """The migration that follows ``current`` (each runs in its own transaction: migrations/env.py)."""
    from alembic.script import ScriptDirectory

    for rev in ScriptDirectory.from_config(_config(engine)).walk_revisions():
        if rev.down_revision == current:
            return rev.revision
    return "?"


def _known(engine: Engine, current: str | None) -> str:
    """The head revision, after checking that ``current`` is one this code knows: a database that
    a newer mfsreg upgraded has revisions this one cannot read (Alembic: "Can't locate revision")."""
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    script = ScriptDirectory.from_config(_config(engine))
    head = _head(script)
    if current is not None:
        try:
            script.get_revision(current)
        except CommandError:
            where = engine.url.render_as_string(hide_password=True)
            raise StorageError(
                f"database {where} is at schema revision {current}, newer than this mfsreg knows "
                f"(up to {head}): upgrade mfsreg to the release that wrote it, or later"
            ) from None
    return head


def ensure_current(engine: Engine, auto_upgrade: bool) -> None:
    """Return if the database is at this code's head revision; otherwise upgrade it (``auto_upgrade``,
    the embedded default) or refuse with the command to run."""
    if _stamped_revision(engine) == known_revisions()[-1]:
        return  # the common case, without importing Alembic
    current = current_revision(engine)
    head = _known(engine, current)
    if current == head:
        return
    if auto_upgrade:
        try:
            upgrade(engine)
        except OperationalError as exc:
            raise StorageError(f"cannot upgrade the embedded database: {str(exc.orig).splitlines()[0]}") from None
        return
    where = engine.url.render_as_string(hide_password=True)
    raise StorageError(
        f"database {where} is at schema revision {current or 'none'}, not {head}: run `mfsreg db upgrade`"
    )


_MIGRATING = (
    0x6D667303  # Postgres advisory lock key: a schema upgrade is running (db/locks.py, db/reclaim.py have others)
)


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """One schema upgrade of a database at a time. SQLite: a lock file beside the database (SQLite's
    own locks would make all but one fail halfway through the DDL); Postgres: a session advisory
    lock on a connection of its own, held while the migrations run on another (two at once failed
    on Postgres' catalog, 'duplicate key value violates unique constraint')."""
    if engine.dialect.name == "postgresql":
        with session_lock(engine, _MIGRATING):
            yield
        return
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:":
        yield
        return
    with lock_file(f"{db}.migrate.lock") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
