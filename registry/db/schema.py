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

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from registry.errors import StorageError

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def _config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision(engine: Engine) -> str:
    return ScriptDirectory.from_config(_config(engine)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> str:
    """Apply every pending migration; returns the revision now in force."""
    command.upgrade(_config(engine), "head")
    return head_revision(engine)


def ensure_current(engine: Engine, auto_upgrade: bool) -> None:
    head = head_revision(engine)
    current = current_revision(engine)
    if current == head:
        return
    if auto_upgrade:
        with _migration_lock(engine):
            if current_revision(engine) != head:  # another process may have just done it
                try:
                    upgrade(engine)
                except OperationalError as exc:
                    raise StorageError(f"cannot upgrade the embedded database: {str(exc.orig).splitlines()[0]}") from None
        return
    where = engine.url.render_as_string(hide_password=True)
    raise StorageError(
        f"database {where} is at schema revision {current or 'none'}, not {head}: run `mfsreg db upgrade`"
    )


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """Processes that open a fresh embedded registry at once take turns to create its schema
    (SQLite's own locks would make all but one fail halfway through the DDL)."""
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:":
        yield
        return
    with open(f"{db}.migrate.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
