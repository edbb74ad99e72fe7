"""Figures in the words and units people use, shared by `mfsreg stats` and the web page (api/web/).
Imports nothing heavy: the CLI's start-up pays for it."""

from __future__ import annotations

from mfsreg.registry.store.tiers import BASE, GROUP, UNIQUE


def human_bytes(n: int | None) -> str:
    """Bytes in binary units (KiB, MiB, GiB), as every table of the CLI and the web page writes them."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def percent(fraction: float) -> str:
    """A share as a whole percent that never rounds a part to 0% or a whole short of it to 100%."""
    if 0 < fraction < 0.01:
        return "<1%"
    if 0.99 < fraction < 1:
        return ">99%"
    return f"{fraction * 100:.0f}%"


def in_words(shares_of: dict) -> str:
    """One version's ``shares`` in words: 'shares 91% with base and 6% with other versions; 3% is
    only in this version (12.00 MiB stored, 9.00 MiB of it as deltas)'."""
    base, group, unique = (shares_of[t] for t in (BASE, GROUP, UNIQUE))
    if not base["bytes"] + group["bytes"] + unique["bytes"]:
        return "holds no chunks"
    total = base["bytes"] + group["bytes"] + unique["bytes"]  # the shares from bytes: fractions are rounded
    said = f"shares {percent(base['bytes'] / total)} with base"
    if group["bytes"]:
        said += f" and {percent(group['bytes'] / total)} with other versions"
    if not unique["bytes"]:
        return said + "; nothing is only in this version"
    deltas = unique["delta_stored_bytes"]
    how = f"{human_bytes(deltas)} of it as deltas" if deltas else "none as deltas"
    return (
        f"{said}; {percent(unique['bytes'] / total)} is only in this version "
        f"({human_bytes(unique['stored_bytes'])} stored, {how})"
    )
