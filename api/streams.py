"""A streamed response that breaks off in one logged line when the store fails mid-stream.

Once a response has started its status is sent, so an error can no longer become a 503: Starlette
then logs a hundred-line traceback ("response already started") and drops the connection. A batch
on the wire (registry/format/wire.py) is length-prefixed, so ending it early is enough for the node to see
that it broke off; what the operator needs is the reason, in one line."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from mfsreg.registry.errors import RegistryError

# uvicorn's own error logger: the line lands in the server's log, in its format, at its level
log = logging.getLogger("uvicorn.error")


def broken_off(stream: Iterator[bytes], what: str) -> Iterator[bytes]:
    """``stream``, ended early with one logged line when the store raises a registry error in it.
    Anything else is a bug, and keeps its traceback."""
    try:
        yield from stream
    except RegistryError as exc:
        log.error("%s broke off: %s", what, exc)
