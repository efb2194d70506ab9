"""The fixed split of `../shared/data/jsonschemabench` into a half to tune on and a half to
report on.

A schema's half is the parity of the SHA-1 of `SUBSET/FILE_NAME`: fixed, independent of
the order files are listed in, and the same on every machine. Thresholds and heuristics
(the loop guard, closing) are tuned on `tune`; every compliance or speed figure the
project reports comes from `held`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HALVES = ("tune", "held", "all")


def half_of(subset: str, name: str) -> str:
    """'tune' or 'held' for the schema file `name` (with its .json) of `subset`."""
    digest = hashlib.sha1(f"{subset}/{name}".encode()).digest()
    return "tune" if digest[-1] % 2 == 0 else "held"


def in_half(path: Path, half: str) -> bool:
    """Whether the schema file at `path` (DATA/SUBSET/NAME.json) belongs to `half`."""
    return half == "all" or half_of(path.parent.name, path.name) == half
