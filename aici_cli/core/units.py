"""Quantities as messages write them."""

from __future__ import annotations


def byte_size(n: int) -> str:
    """A byte count as messages about limits show it: "256 MiB", "1.5 KiB", "100 bytes"
    (the largest binary unit it reaches, to `:g`'s six significant digits)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"
