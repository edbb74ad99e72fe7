"""The database engine: SQLite (WAL) for the embedded default, Postgres through psycopg 3.

Transactions come from ``read_tx`` and ``write_tx``. On SQLite a write transaction starts with
BEGIN IMMEDIATE, so two processes that push at once queue for the write lock up front instead of
failing when a read lock cannot be upgraded; on Postgres writers lock their family row instead
(see db/versions.py).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import NullPool

from mfsreg.registry.errors import InvalidRequest, StorageError

_WRITE = "mfsreg_write"
WAL_SWITCH_SECONDS = 60.0  # as long as the busy timeout: how long a new database may take to become WAL


SUPPORTED = "sqlite:////absolute/path or postgresql://user@host/db (psycopg 3)"


def create_db_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
        parsed.port  # a port that is not a number fails here, not at the first query  # noqa: B018
    except (ArgumentError, ValueError):
        raise InvalidRequest(f"MFSREG_DATABASE_URL={_redacted(url)} is not a database URL: use {SUPPORTED}") from None
    try:
        if parsed.get_backend_name() == "sqlite":
            database = _check_sqlite_path(url, parsed.database)
            if parsed.query:  # ?mode=ro was dropped with a warning on stderr, and the database made anyway
                raise InvalidRequest(
                    f"MFSREG_DATABASE_URL={url} carries options ({', '.join(sorted(parsed.query))}), "
                    "which mfsreg does not pass to SQLite: give the path alone, sqlite:////srv/mfsreg/registry.db"
                )
            _make_private(Path(database))
            engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 60, "check_same_thread": False})
            _sqlite_events(engine)
            return engine
        if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
            url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
        return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)
    except (NoSuchModuleError, ImportError):  # another database, or a driver this install lacks
        raise InvalidRequest(
            f"MFSREG_DATABASE_URL names driver {parsed.drivername!r}, which mfsreg does not use: use {SUPPORTED}"
        ) from None


def _make_private(database: Path) -> None:
    """The database's folder (0700) and file (0600), less a stricter umask, where they are new: they
    hold the token hashes and every version's record. SQLite gives its -wal and -shm files the
    database file's mode."""
    if not database.parent.is_dir():
        database.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not database.exists():
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT, 0o600))


def _check_sqlite_path(url: str, database: str | None) -> str:
    """A registry's SQLite file is named by an absolute path (returned). With three slashes SQLAlchemy
    reads the rest as relative to the current directory, so each directory a command ran from would
    quietly get a registry of its own; an in-memory database keeps no version past the command."""
    if not database or database == ":memory:":
        raise InvalidRequest(
            f"MFSREG_DATABASE_URL={url} names no database file (an in-memory one keeps nothing "
            "past the command): give a path, sqlite:////srv/mfsreg/registry.db"
        )
    if database.startswith("file:"):
        raise InvalidRequest(
            f"MFSREG_DATABASE_URL={url}: mfsreg does not take SQLite URI file names; give a path, "
            "sqlite:////srv/mfsreg/registry.db"
        )
    if not Path(database).is_absolute():
        raise InvalidRequest(
            f"MFSREG_DATABASE_URL={url} names {database!r}, a path relative to the current directory: "
            f"give an absolute path, after four slashes (here: sqlite:///{Path(database).absolute()})"
        )
    return database


def _redacted(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "(unparseable)"


def _sqlite_events(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        _switch_to_wal(cur)
        cur.execute("PRAGMA synchronous=FULL")  # a committed version survives a power cut
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


def _switch_to_wal(cur) -> None:
    """PRAGMA journal_mode=WAL, retried while another connection holds the lock it needs. Two
    processes that open a new database at once (two pushes into a fresh MFSREG_HOME) both switch
    it; SQLite answers one "database is locked" at once, without its busy timeout, since each
    holds a shared lock the other must give up. The switch is stored in the file, so only a
    database's first connections can meet this (one push in six failed that way in the tests)."""
    deadline = time.monotonic() + WAL_SWITCH_SECONDS
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@contextmanager
def write_tx(engine: Engine) -> Iterator[Connection]:
    """A transaction that will write; committed on normal exit, rolled back on an exception."""
    with storage_errors(engine):
        with _connect(engine).execution_options(**{_WRITE: True}) as conn, conn.begin():
            yield conn


@contextmanager
def read_tx(engine: Engine) -> Iterator[Connection]:
    """A read transaction whose queries all see one snapshot. Postgres's default (read committed)
    gives each statement its own: a delete or prune committed between two reads (a version, then
    its manifest; a family's chunks, then where they are stored) made the second miss rows the
    first found, a 500. A read-only repeatable-read transaction never fails to serialize. SQLite's
    read transactions (WAL) already keep one snapshot."""
    with storage_errors(engine):
        with _connect(engine) as conn:
            if engine.dialect.name == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn


def _connect(engine: Engine) -> Connection:
    """A connection. Besides an unreachable server (OperationalError, storage_errors), what fails
    here is the URL's target or options: a file that is not a database, a connect option the
    driver refuses. Mid-transaction such errors would be this code's own, and stay as they are."""
    try:
        return engine.connect()
    except OperationalError:
        raise
    except DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else exc.__class__.__name__
        raise StorageError(
            f"database {engine.url.render_as_string(hide_password=True)}: {reason}; check "
            "MFSREG_DATABASE_URL (a database of mfsreg's, with options its driver takes)"
        ) from None


def lost_connection(exc: DBAPIError) -> bool:
    """Whether a database error means the server cannot be reached or the connection is gone (an
    OperationalError, or any error SQLAlchemy takes for a disconnect: psycopg's InterfaceError on
    a connection a reset closed), not a fault of the query."""
    return isinstance(exc, OperationalError) or exc.connection_invalidated


@contextmanager
def storage_errors(engine: Engine) -> Iterator[None]:
    """The database unreachable, or its connection lost mid-query (lost_connection), as one
    StorageError line; other errors stay as they are."""
    try:
        yield
    except DBAPIError as exc:
        if not lost_connection(exc):
            raise
        where = engine.url.render_as_string(hide_password=True)
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else "unknown error"
        check = (
            "that this process may read and write the file"
            if engine.dialect.name == "sqlite"
            else "that the server runs"
        )
        raise StorageError(f"database {where}: {reason}; check MFSREG_DATABASE_URL and {check}") from None
