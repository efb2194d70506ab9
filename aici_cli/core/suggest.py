"""The suggestion a message makes for a mistyped name, as Click makes one for a mistyped
option: the known name closest to it, where one is close enough (difflib)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

# How alike (difflib's ratio) a known name must be to be suggested.
CUTOFF = 0.75


def did_you_mean(unknown: Sequence[str], known: Iterable[str], alone: bool = False) -> str:
    """`did you mean 'temperature' for 'temprature'?` for the `unknown` names close to one
    of `known` (several joined: `'a' for 'x', 'b' for 'y'`), "" when none is close.
    `alone`: a single unknown name's suggestion names the known one only (`did you mean
    'prompt'?`)."""
    names = sorted(known)
    pairs = [(u, m[0]) for u in unknown
             if (m := difflib.get_close_matches(u, names, n=1, cutoff=CUTOFF))]
    if not pairs:
        return ""
    if alone and len(pairs) == 1 and len(unknown) == 1:
        return f"did you mean '{pairs[0][1]}'?"
    return "did you mean " + ", ".join(f"'{m}' for '{u}'" for u, m in pairs) + "?"
