"""Tier policy: which chunks of a family are base, group or unique.

- base: ``users`` >= threshold = ceil(base_quorum * members), at least 1
- group: used by two or more members, below the threshold
- unique: used by one member

A push or delete re-tiers only the rows whose tier can change (db/rebalance.py).
See docs/design/tiers.md.
"""

from __future__ import annotations

import math

BASE, GROUP, UNIQUE = "base", "group", "unique"
TIERS = (BASE, GROUP, UNIQUE)
# Order in which a node cache drops chunks first (unique) to last (base).
EVICTION_ORDER = (UNIQUE, GROUP, BASE)


def threshold(members: int, base_quorum: float) -> int:
    """The number of users from which a chunk is in base."""
    if members <= 0:
        return 1
    # The small epsilon keeps 0.3 * 10 from becoming 4 through float rounding.
    return max(1, math.ceil(base_quorum * members - 1e-9))


def tier_of(users: int, members: int, base_quorum: float) -> str:
    if users >= threshold(members, base_quorum):
        return BASE
    return GROUP if users >= 2 else UNIQUE


def check_quorum(value: float) -> float:
    from mfsreg.registry.errors import InvalidRequest

    if not 0.0 < value <= 1.0:
        raise InvalidRequest(f"base_quorum {value} is out of range: use a fraction in (0, 1]")
    return value
