"""Run the `mfsreg` command as a user would: in this process by default, or as the installed console
script where the test is about the process (signals, exit codes of a killed run, argv that is not
UTF-8, `serve` itself).

In process, a command gets its own environment (``env`` replaces os.environ while it runs), its own
standard streams (pipes to the command, as under ``capture_output``), the signal handlers and
working directory it found restored afterwards, and the registry's warnings on its stderr as an
unconfigured interpreter prints them. ``MFSREG_TEST_PROCESS=1`` runs every command as a process:
the switch to check that nothing passes only in process (restic's integration tests have the same).
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

MFSREG = str(Path(sys.executable).with_name("mfsreg"))
ALWAYS_PROCESS = os.environ.get("MFSREG_TEST_PROCESS", "") not in ("", "0")
_one_at_a_time = threading.Lock()  # a command in process owns os.environ and the standard streams


@dataclass
class Ran:
    """What a command left: the fields of subprocess.CompletedProcess the tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def mfsreg(
    *args, env: dict, check: bool = True, timeout: float = 300, process: bool = False, cwd: str | Path | None = None
) -> Ran | subprocess.CompletedProcess:
    """`mfsreg ARGS` with environment ``env``; with ``check``, an exit code other than 0 fails the test."""
    argv = [str(a) for a in args]
    if process or ALWAYS_PROCESS:
        ran = subprocess.run([MFSREG, *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    else:
        ran = in_process(argv, env, cwd)
    if check and ran.returncode != 0:
        raise AssertionError(f"mfsreg {' '.join(argv)} exited {ran.returncode}: {ran.stderr}")
    return ran


def mfsreg_json(*args, env: dict, **kwargs) -> dict:
    return json.loads(mfsreg(*args, "--json", env=env, **kwargs).stdout)


class _NotServerThreads(logging.Filter):
    """Keeps the records of the command's own threads: a server running in this process (tests/server.py)
    logs from its event loop, its request threads and its registry's pool, which are named so."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith(("AnyIO worker thread", "mfsreg-server"))


def in_process(argv: list[str], env: dict, cwd: str | Path | None = None) -> Ran:
    from mfsreg.cli import exits as errors
    from mfsreg.cli.main import main

    out, err = io.BytesIO(), io.BytesIO()
    stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True)
    with _one_at_a_time, _environment(env, cwd), _streams(stdout, stderr), _warnings_to(stderr):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc, stderr)
        except BaseException:  # what the interpreter does with an exception nothing caught
            traceback.print_exc(file=stderr)
            code = 1
        finally:
            errors._signalled.clear()
    return Ran(argv, code, out.getvalue().decode("utf-8"), err.getvalue().decode("utf-8"))


def _exit_code(exc: SystemExit, stderr) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=stderr)
    return 1


class _environment:
    """os.environ, the working directory and the handlers of the signals the CLI catches, as
    ``env`` and ``cwd`` say while the command runs, and as they were afterwards."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self, env: dict, cwd):
        self.env, self.cwd = env, cwd

    def __enter__(self):
        self.saved_env = dict(os.environ)
        self.saved_cwd = os.getcwd()
        self.saved_handlers = {s: signal.getsignal(s) for s in self.SIGNALS}
        os.environ.clear()
        os.environ.update(self.env)
        if self.cwd is not None:
            os.chdir(self.cwd)

    def __exit__(self, *exc):
        os.chdir(self.saved_cwd)
        for s, handler in self.saved_handlers.items():
            signal.signal(s, handler)
        os.environ.clear()
        os.environ.update(self.saved_env)


class _streams:
    def __init__(self, stdout, stderr):
        self.new = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), stdout, stderr)

    def __enter__(self):
        self.saved = (sys.stdin, sys.stdout, sys.stderr)
        sys.stdin, sys.stdout, sys.stderr = self.new

    def __exit__(self, *exc):
        sys.stdin, sys.stdout, sys.stderr = self.saved


class _warnings_to:
    """Python warnings and the "mfsreg" logger's records on ``stderr``, each time they happen, as a
    fresh interpreter with no logging set up prints them (logging's last resort: the message alone)."""

    def __init__(self, stderr):
        self.handler = logging.StreamHandler(stderr)
        self.handler.setLevel(logging.WARNING)
        self.handler.addFilter(_NotServerThreads())
        self.catch = warnings.catch_warnings()

    def __enter__(self):
        self.catch.__enter__()
        warnings.resetwarnings()  # a fresh interpreter's filters (Python's warnings docs, "Default Warning Filter")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        stream = self.handler.stream
        warnings.showwarning = lambda msg, cat, fn, line, file=None, text=None: stream.write(
            warnings.formatwarning(msg, cat, fn, line, text)
        )
        self.logger = logging.getLogger("mfsreg")
        self.saved = self.logger.propagate
        self.logger.addHandler(self.handler)
        self.logger.propagate = False

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.propagate = self.saved
        self.catch.__exit__(*exc)
