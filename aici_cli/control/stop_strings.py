"""The stop-string scan shared by lines (`stop`) and wasm segments (`segment.stop`)."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], checked: int, floor: int = 0) -> int | None:
    """Where the earliest of `stops` starts in `text`, or None.

    `checked` characters of `text` were searched before (and the text only grew since):
    the scan starts where a stop string could first end after them, so a long output is
    not searched again from the start at every token. Callers reset `checked` to 0 when
    they rewrite the text (a backtrack). A stop string counts only where it ends past
    `floor` characters (the text of a line's first min_tokens tokens, as in vLLM).
    """
    if not stops:
        return None
    start = max(0, checked - max(len(s) for s in stops) + 1)
    hits = [p for p in (text.find(s, max(start, floor - len(s) + 1)) for s in stops) if p >= 0]
    return min(hits) if hits else None
