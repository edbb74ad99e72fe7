"""The CLI's one table from error type to exit code, and the wrapper that applies it.

A user's mistake prints one line on stderr and exits non-zero; no traceback ever reaches a user
for bad input. Unexpected errors still print one line, plus a hint to re-run with MFSREG_DEBUG=1.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from typing import TYPE_CHECKING

from mfsreg.registry import errors as e

if TYPE_CHECKING:
    from typer._click.exceptions import UsageError

EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (e.InvalidName, 2),
    (e.InvalidModel, 2),
    (e.InvalidRequest, 2),
    (e.NotFound, 2),
    (e.Conflict, 2),
    (e.TooLarge, 2),
    (e.Unauthorized, 3),
    (e.Forbidden, 3),
    (e.IntegrityError, 4),
    (e.StorageError, 5),
    (e.RegistryError, 1),
]


# What to do about a path the user gave (MFSREG_HOME, MFSREG_CACHE_DIR, -o, a model path) that
# the filesystem refused: the OSError says only what went wrong.
_HINTS = {
    FileExistsError: ": a file is where a directory is needed; move it away or give another path",
    NotADirectoryError: ": a path above it is a file, not a directory; move it away or give another path",
    IsADirectoryError: ": a directory is where a file is needed; move it away or give another path",
    PermissionError: ": this user may not use it; change its permissions or give another path",
    FileNotFoundError: ": check the path",
}


def _undecoded(text) -> bool:
    """Whether ``text`` holds bytes Python could not decode from the command line or environment
    (kept as lone surrogates): a user's value, not a bug."""
    return isinstance(text, str) and any("\udc80" <= ch <= "\udcff" for ch in text)


def exit_code(exc: BaseException) -> int:
    for kind, code in EXIT_CODES:
        if isinstance(exc, kind):
            return code
    return 1


def fail(message: str, code: int) -> None:
    if not message.isprintable():  # a path or value with a newline, or an escape sequence a terminal acts on
        message = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in message)
    try:
        print(f"mfsreg: error: {message}", file=sys.stderr)
    except OSError:  # no terminal left to say it on (a SIGHUP's): the exit code still does
        pass
    raise SystemExit(code)


def usage_error_type() -> type[UsageError]:
    """click's UsageError: Typer carries its own copy of click, whose UsageError it does not
    export, so it is found through the BadParameter it does (a subclass of it)."""
    import typer

    return next(k for k in typer.BadParameter.__mro__ if k.__name__ == "UsageError")


# SIGTERM or SIGHUP (`timeout`, `kill`, a closed terminal) unwinds the command as Ctrl-C does: the
# default action killed it on the spot, leaving a pull's temp file of hundreds of MiB beside its
# output, which a second pull does not remove. click turns the KeyboardInterrupt into an Abort (or
# Typer into exit code 130), so the signal is noted here.
_signalled: list[int] = []


def _terminated(signum, frame) -> None:
    _signalled.append(signum)
    signal.signal(signum, signal.SIG_DFL)  # a second one ends it at once
    raise KeyboardInterrupt


def _fail_if_signalled() -> None:
    """Exit 128 + the signal, in one line, if SIGTERM or SIGHUP stopped the command."""
    if _signalled:
        fail(
            f"stopped by {signal.Signals(_signalled[0]).name}; nothing partial was committed, re-run to continue",
            128 + _signalled[0],
        )


def run_guarded(fn) -> None:
    """Run the Typer app, turning every error into one line and an exit code."""
    import threading

    import typer

    usage_error = usage_error_type()
    if threading.current_thread() is threading.main_thread():  # only there may handlers be set
        for signum in (signal.SIGTERM, signal.SIGHUP):  # `serve` hands them to uvicorn, which sets its own
            signal.signal(signum, _terminated)
    try:
        code = fn()
        if code == 130:  # Ctrl-C: Typer catches the KeyboardInterrupt itself and returns its exit code
            raise KeyboardInterrupt
        if isinstance(code, int) and code:  # click's own exits return their code
            raise SystemExit(code)
    except usage_error as exc:
        if not exc.format_message().strip():  # a bare group (`mfsreg`, `mfsreg cache`): its help is printed
            raise SystemExit(exc.exit_code) from None
        ctx = getattr(exc, "ctx", None)
        where = f"`{ctx.command_path} --help`" if ctx is not None else "`mfsreg --help`"
        fail(f"{' '.join(exc.format_message().split())} (see {where})", 2)
    except e.RegistryError as exc:
        fail(str(exc), exit_code(exc))
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C (or a signal above), seen by Python or by click first
        _fail_if_signalled()
        fail("interrupted; nothing partial was committed, re-run to continue", 130)
    except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        fail(f"{exc.filename or ''}: {exc.strerror}{_HINTS.get(type(exc), '')}", 2)
    except OSError as exc:
        if exc.errno == errno.EROFS:  # a path given on a read-only mount: the user's to move
            fail(
                f"{exc.filename or ''}: {exc.strerror}: that filesystem is mounted read-only; give a path elsewhere, "
                "or remount it read-write",
                2,
            )
        if os.environ.get("MFSREG_DEBUG"):
            raise
        fail(f"{exc.strerror or exc}: {exc.filename or ''}", 1)
    except UnicodeEncodeError as exc:
        if not _undecoded(exc.object) or os.environ.get("MFSREG_DEBUG"):
            raise
        given = exc.object.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        fail(f"'{given}' is not UTF-8 text: give arguments and MFSREG_* settings in UTF-8", 2)
    except Exception as exc:  # a bug, not a user mistake: still one line unless debugging
        # the signal's KeyboardInterrupt can come out as another error while the command unwinds
        # (raised inside Condition.wait, it leaves a lock that a `with` then releases again)
        _fail_if_signalled()
        if os.environ.get("MFSREG_DEBUG"):
            raise
        fail(f"internal error: {exc.__class__.__name__}: {exc} (re-run with MFSREG_DEBUG=1 for a traceback)", 1)
