"""The HTTP protocol's version, carried by every /v1/ request and answer in the ``Mfsreg-Protocol``
header. A server answers its own version and the one before; a request of another is refused with
one line that says which side to upgrade, to which release. A request without the header is taken
for version 1, what clients of release 0.1 speak. See docs/design/protocol.md."""

from __future__ import annotations

from mfsreg.registry.errors import InvalidRequest, shown

HEADER = "Mfsreg-Protocol"
CURRENT = 2  # 2: release 0.2.0, the header itself; 1: release 0.1, which sent none
OLDEST = CURRENT - 1  # a server answers the previous version too
RELEASE = {1: "0.1.0", 2: "0.2.0"}  # the first release that speaks each version


def check(value: str | None) -> int:
    """The version a request speaks, or InvalidRequest saying what to upgrade."""
    if value is None:
        return 1
    if not value.isascii() or not value.isdigit() or len(value) > 4:
        raise InvalidRequest(
            f"{HEADER}: {shown(value, 20)} is not a protocol version: send a whole number, e.g. {CURRENT}"
        )
    version = int(value)
    if version > CURRENT:
        raise InvalidRequest(
            f"this client speaks mfsreg protocol {version}; this server speaks {OLDEST} to {CURRENT}: "
            f"upgrade the server to a release that speaks {version}, or use a client of release {RELEASE[CURRENT]}"
        )
    if version < OLDEST:
        raise InvalidRequest(
            f"this client speaks mfsreg protocol {version}, which this server no longer answers: "
            f"upgrade the client to release {RELEASE[OLDEST]} or later"
        )
    return version
