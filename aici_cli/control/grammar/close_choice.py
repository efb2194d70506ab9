"""Which completion closes a value early (early_close.py's `Close`), where the schema says
more than the grammar: the first completion whose closed output the schema's validator
accepts and the keyword guard finds no fault in, else the closer's first.

Costs a validation (and a keyword scan) per completion tried, at most STEER_WALKS +
VARIANTS + 1 walks (~1 ms each on a small schema), once a line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llguidance

from aici_cli.control.grammar.closing import Closer
from aici_cli.control.grammar.hints import Hints

# Other completions tried where the schema rejects the first (a walk and a validation
# each, once a line).
VARIANTS = 8
# Walks a close's completion is steered through (`steered`): the k-th repeated item of a
# `uniqueItems` array takes up to k of them.
STEER_WALKS = 16


@dataclass(frozen=True)
class CloseChoice:
    """A line's closer and schema checks. `accepts`: whether a whole output is a valid
    value (the schema's validator); `fault_at`: the keyword guard's first fault in an
    output (where the mended value begins, where it ends), or None."""

    closer: Closer
    hints: Hints
    accepts: Callable[[str], bool] | None
    fault_at: Callable[[bytes], tuple[int, int] | None] | None

    def accepted(self, m: llguidance.LLMatcher, written: bytes, left: int,
                 tokens: list[int]) -> list[int]:
        """`tokens`, or where the value they close after `written` breaks the schema,
        another completion from `m` (within `left` tokens) that keeps it: first the walk
        steered away from each fault the keyword guard finds in it (`steered`), then the
        walk with one of its choices barred (`Closer.variants`). The schema's own verdict
        stays on the line (`valid`) where none keeps it."""
        if self.keeps(written, tokens):
            return tokens
        text = written.decode("utf-8", "replace")
        steered = self.steered(m, written, text, left)
        if steered is not None:
            return steered
        for other in self.closer.variants(m, text, left, self.hints, VARIANTS):
            if self.keeps(written, other):
                return other
        return tokens

    def keeps(self, written: bytes, tokens: list[int]) -> bool:
        """Whether the output `written` closed by `tokens` keeps the schema: its
        validator's verdict and no fault of the keyword guard's."""
        whole = written + self.closer.decode_bytes(tokens)
        if self.accepts is not None and not self.accepts(whole.decode("utf-8", "replace")):
            return False
        return self.fault_at is None or self.fault_at(whole) is None

    def steered(self, m: llguidance.LLMatcher, written: bytes, text: str,
                left: int) -> list[int] | None:
        """The completion walked again, up to STEER_WALKS times, each time with the choice
        that began the first fault in it barred there too (bars accumulate: a third
        repeated item is barred its first letter, then its second): a completion that
        keeps `uniqueItems` or `minProperties`, which one bar at a time cannot reach.
        None where the keyword guard is off, or a fault lies all in what the model wrote."""
        if self.fault_at is None:
            return None
        bars: set[tuple[int, int]] = set()
        for _ in range(STEER_WALKS):
            tokens, choices = self.closer.walk(m, text, left, self.hints, frozenset(bars))
            if tokens is None:
                return None
            if self.keeps(written, tokens):
                return tokens
            fault = self.fault_at(written + self.closer.decode_bytes(tokens))
            if fault is None or fault[1] <= len(written):  # all of it the model's
                return None
            # The completion's first choice from the fault's first byte on (or from the
            # completion's start, where the value began in what the model wrote).
            starts, size = [], len(written)
            for t in tokens:
                starts.append(size)
                size += len(self.closer.decode_bytes([t]))
            chosen = next(((p, t) for p, t in choices if starts[p] >= fault[0]), None)
            if chosen is None or chosen in bars:
                return None
            bars.add(chosen)
        return None
