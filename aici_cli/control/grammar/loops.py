"""Knowing a loop when one is written: the loop guard's detector.

A small model that loops inside a constrained value repeats *text*, not tokens: a digit
run `"1234567890123…"` whose period (10 characters) is no whole number of tokens, a key
that grows `_self_self_self`, a run of U+205F spaces, list items `, dark, dark`, whole
key/value pairs again and again. So the detector works on the decoded text: the output
loops when its tail is one unit of `p` characters (1 <= p <= MAX_PERIOD) repeated,
covering at least `min_span(p)` characters. The unit may start anywhere (inside a token,
inside a string, across a separator), so any period is caught, whatever the
tokenization, and the verdict at a given character does not depend on how many tokens a
step appended (drafts on or off).

Thresholds (`min_span`): a unit repeated at least MIN_REPEATS times *and* over at least
MIN_SPAN characters: a unit of MIN_SPAN / 2 characters or more (a key/value pair, a list
item) is known at its second unit, a shorter one (a digit, a space) once its run covers
MIN_SPAN characters. Every pass a loop runs on before it is known is a pass spent on
tokens taken back, so it is known as early as false positives allow: their rate on the
`tune` half of the schema split (bench/data_split.py) is measured by `bench/loop_guard.py`.

Cost: one `str.rfind` per call in the common case (no recent repeat of the last
MIN_SPAN // 2 characters), a few slice compares otherwise; microseconds per token.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

# The longest unit looked for (characters): a repeated key/value pair or list item.
MAX_PERIOD = 200
# A loop covers at least this many characters ...
MIN_SPAN = 20
# ... and holds its unit at least this many times: known at its second unit.
MIN_REPEATS = 2
# How much of the output's tail is looked at (characters): the longest loop that must be
# seen whole is MIN_REPEATS units of MAX_PERIOD.
WINDOW = MAX_PERIOD * MIN_REPEATS + MAX_PERIOD


@dataclass(frozen=True)
class Loop:
    """A loop at the end of a text: its unit of `period` characters covers the last
    `span` characters (span >= period * MIN_REPEATS and >= MIN_SPAN)."""

    period: int
    span: int


def min_span(period: int) -> int:
    """The characters a unit of `period` characters must cover to count as a loop."""
    return max(MIN_SPAN, MIN_REPEATS * period)


def periodic_tail(text: str, period: int) -> int:
    """How many of `text`'s last characters repeat with `period`: the largest s such that
    text[-s:] equals the text `period` characters earlier, plus `period` (the first
    unit). 0 when not even one character repeats."""
    n = len(text)
    if period >= n or text[-1] != text[-1 - period]:
        return 0
    # Grow a matched span by doubling, then bisect: slice compares run in C.
    lo, hi = 1, 1
    while hi <= n - period and text[n - hi :] == text[n - hi - period : n - period]:
        lo, hi = hi, hi * 2
    hi = min(hi, n - period + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text[n - mid :] == text[n - mid - period : n - period]:
            lo = mid
        else:
            hi = mid
    return lo + period


def find_loop(text: str) -> Loop | None:
    """The loop `text` ends in, or None. Shortest qualifying period first."""
    tail = text[-WINDOW:]
    n = len(tail)
    if n < MIN_SPAN:
        return None
    # A loop of period p covering s >= p + probe characters has its last `probe` characters
    # again exactly p earlier: the candidate periods are where they recur.
    probe = MIN_SPAN // 2
    key = tail[n - probe :]
    bound = n - 1  # earlier occurrences only: those that start before n - probe
    while True:
        at = tail.rfind(key, 0, bound)
        if at < 0:
            return None
        period = n - probe - at
        if period > MAX_PERIOD:
            return None
        span = periodic_tail(tail, period)
        if span >= min_span(period):
            return Loop(period, span)
        bound = at + probe - 1

def loop_start(text: bytearray, tail: str, loop: Loop) -> int:
    """The byte offset in the output `text` where `loop`'s text begins (`tail` being its
    last `4 * WINDOW` bytes decoded with errors="replace"): found by encoding the
    looping suffix, checked against the bytes where a replaced byte may differ."""
    suffix = tail[len(tail) - loop.span :]
    raw = bytes(text[-4 * WINDOW :])
    guess = len(raw) - len(suffix.encode("utf-8"))
    for at in sorted(range(guess - 3, guess + 4), key=lambda b: abs(b - guess)):
        if 0 <= at <= len(raw) and raw[at:].decode("utf-8", "replace") == suffix:
            guess = at
            break
    return len(text) - len(raw) + max(0, min(guess, len(raw)))


def tokens_in(ends: list[int], first: int, loop: Loop) -> int:
    """How many tokens from `first` one unit of `loop` takes, `ends` being the output's
    bytes after each token."""
    start = ends[first - 1] if first else 0
    return bisect_right(ends, start + loop.period) - first


def second_unit(ends: list[int], begun: int, tail: str, loop: Loop) -> int:
    """The position (tokens, `ends` being the output's bytes after each) of the token
    that holds the first byte of `loop`'s second unit, its text beginning at byte
    `begun`: from there on is the loop (the first unit stays)."""
    return bisect_right(ends, begun + len(
        tail[len(tail) - loop.span :][: loop.period].encode("utf-8")))
