"""When to finish a constrained value early, and with what: a sequence's closing plan.

Two promises, for every JSON-schema, grammar and tool-call line (on by default):

- **Nothing cut off at the limit.** The sequence always holds a *plan*: a position in its
  output and a completion from there (closing.py's `Closer`) that ends within
  `max_tokens`. The plan is renewed every `REPLAN_EVERY` tokens, and at every token once
  the budget left is within `NEAR` tokens of the plan's completion. When the completion
  from the current position leaves at most `MARGIN` tokens spare, it is fast-forwarded
  and the sequence ends. When no completion from the current position fits (the model
  opened one more nested object than the budget can close, or the walk finds none), the
  sequence goes back to the plan's position and takes the plan's completion: a backtrack
  of the tokens since, never a cut-off output. Only a value whose very first completion
  does not fit `max_tokens` can still end cut off.
- **Loops end** (`loops.find_loop` on the output's text): the value is closed at once.
  When no completion from the current position is found, the sequence goes back to its
  plan, if it holds one, and takes the plan's completion (reason "loop"); with no plan
  either, the output is cut where the loop's text begins and the sequence stops
  (reason "loop_unclosable", finish_reason "length": not a valid value, but no run on
  to `max_tokens`).

Cost: a completion walk (a matcher copy and a few token checks per completion token) every
`REPLAN_EVERY` tokens, and at each token near the limit; the loop check is microseconds
(a loop ends the sequence, so it costs one walk, once).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance

from aici_cli.control.grammar.closing import Closer
from aici_cli.control.grammar.hints import NO_HINTS, Hints
from aici_cli.control.grammar.loops import WINDOW, Loop, find_loop

# A fresh plan is made at least this often (tokens), so a backtrack to it loses little.
REPLAN_EVERY = 8
# Tokens in hand beyond the completion at which the plan is checked at every token.
NEAR = 16
# Tokens kept in hand beyond the completion's length when closing at the limit: the
# model may still end the value on its own within them.
MARGIN = 4
# The longest completion looked for (tokens): bounds a walk's cost where the closer finds
# no way to the end (it then tries every token up to here).
WALK_LIMIT = 256
# Other completions tried where the schema rejects the first (a walk and a validation
# each, once a line).
VARIANTS = 8
# The close reason of a loop neither the current position nor a plan could close: the
# output is cut where the loop begins, and the sequence ends as at the limit ("length").
UNCLOSABLE = "loop_unclosable"


@dataclass(frozen=True)
class Closing:
    """What a line may finish early for (`--close-at-limit`, `--loop-guard`), its budget,
    and the run's closer."""

    closer: Closer
    max_tokens: int
    at_limit: bool = True
    loop_guard: bool = True


@dataclass(frozen=True)
class Close:
    """A decision to finish now: drop the last `backtrack` tokens, then append `tokens`
    (already consumed by the matcher) and stop. `reason`: "limit", "loop" or
    `UNCLOSABLE` (then `tokens` is empty: the output is cut, not closed)."""

    backtrack: int
    tokens: list[int]
    reason: str


class EarlyClose:
    """One sequence's closing state; see the module docstring. Sees every token the
    matcher consumes (`consumed`), in order, and decides after each batch of them
    (`decide`)."""

    def __init__(self, closing: Closing, hints: Hints = NO_HINTS,
                 accepts: Callable[[str], bool] | None = None) -> None:
        """`hints`: the schema's, for the completion walk (hints.py). `accepts`: whether a
        whole output is a valid value (the schema's validator), where the grammar does not
        say it all: a close takes the first completion it accepts, if any does."""
        self.closing = closing
        self.hints = hints
        self.accepts = accepts
        self.token_bytes = closing.closer.decode_bytes
        self.tokens: list[int] = []
        self._text = bytearray()  # the output's bytes
        self._ends: list[int] = []  # len(self._text) after each token
        self._plan: tuple[int, list[int]] | None = None  # (position, completion)
        self.reason: str | None = None  # set once the sequence was closed early
        self.sampled = False  # the model has written a token (closing waits for one)

    def consumed(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            self._text += self.token_bytes([t])
            self._ends.append(len(self._text))

    def rollback(self, n: int) -> None:
        """The last `n` tokens were taken back (the keyword guard's retry): a plan made
        past the new end goes with them; one made before it still holds."""
        if not n:
            return
        keep = len(self.tokens) - n
        del self.tokens[keep:]
        del self._ends[keep:]
        del self._text[self._ends[-1] if self._ends else 0 :]
        if self._plan is not None and self._plan[0] > keep:
            self._plan = None

    def text(self, tail: int | None = None) -> str:
        raw = self._text if tail is None else self._text[-tail:]
        return bytes(raw).decode("utf-8", "replace")

    def decide(self, m: llguidance.LLMatcher) -> Close | None:
        """Whether to finish now, from `m`, the matcher after every token so far. A
        returned `Close` is already applied to `m` (rolled back, completion consumed)."""
        c = self.closing
        if m.is_stopped() or m.is_accepting() or m.is_error():
            return None
        pos = len(self.tokens)
        left = c.max_tokens - pos
        tail = self.text(tail=4 * WINDOW) if c.loop_guard else ""
        loop = find_loop(tail) if c.loop_guard else None
        if loop is not None:
            return self._end_loop(m, left, tail, loop)
        if not c.at_limit:
            return None
        plan = self._plan
        near = plan is not None and left <= len(plan[1]) + NEAR
        if plan is not None and not near and pos - plan[0] < REPLAN_EVERY:
            return None
        done = self._complete(m, left)
        if done is not None:
            self._plan = (pos, done)
            # Not before the model's first token (at `start`, after the grammar's forced
            # opening): a line then takes at least one pass, so its logprobs are read, and
            # the plan still holds if that token does not fit.
            if left - len(done) <= MARGIN and self.sampled:
                return self._close(m, 0, done, "limit")
            return None
        if plan is not None and near:  # no way on from here fits: back to the plan
            return self._close(m, pos - plan[0], plan[1], "limit")
        return None

    def _end_loop(self, m: llguidance.LLMatcher, left: int, tail: str,
                  loop: Loop) -> Close | None:
        """`tail` (the output's last bytes, decoded) ends in `loop`: close the value from
        here, or from the plan (a backtrack), or else cut the output where the loop
        begins."""
        done = self._complete(m, left)
        if done is not None:
            return self._close(m, 0, done, "loop")
        plan = self._plan
        if plan is not None:  # a valid value is better than a cut one
            return self._close(m, len(self.tokens) - plan[0], plan[1], "loop")
        keep = bisect_right(self._ends, self._loop_start(tail, loop))
        return self._close(m, len(self.tokens) - keep, [], UNCLOSABLE)

    def _loop_start(self, tail: str, loop: Loop) -> int:
        """The byte offset in the output where `loop`'s text begins (`tail` being the
        last `4 * WINDOW` bytes decoded with errors="replace"): found by encoding the
        looping suffix, checked against the bytes where a replaced byte may differ."""
        suffix = tail[len(tail) - loop.span :]
        raw = bytes(self._text[-4 * WINDOW :])
        guess = len(raw) - len(suffix.encode("utf-8"))
        for at in sorted(range(guess - 3, guess + 4), key=lambda b: abs(b - guess)):
            if 0 <= at <= len(raw) and raw[at:].decode("utf-8", "replace") == suffix:
                guess = at
                break
        return len(self._text) - len(raw) + max(0, min(guess, len(raw)))

    def _complete(self, m: llguidance.LLMatcher, left: int) -> list[int] | None:
        done = self.closing.closer.completion(m, self.text(), min(left, WALK_LIMIT),
                                              self.hints)
        return done if done else None

    def _accepted(self, m: llguidance.LLMatcher, tokens: list[int]) -> list[int]:
        """`tokens`, or where the schema rejects the value they close, the first other
        completion from here (`Closer.variants`, within the budget) that it accepts; the
        schema's own verdict stays on the line (`valid`) where none does. Costs a
        validation per completion tried, once a line."""
        text = self.text()
        decode = self.token_bytes
        if self.accepts is None or self.accepts(text + decode(tokens).decode("utf-8", "replace")):
            return tokens
        left = min(self.closing.max_tokens - len(self.tokens), WALK_LIMIT)
        for other in self.closing.closer.variants(m, text, left, self.hints, VARIANTS):
            if self.accepts(text + decode(other).decode("utf-8", "replace")):
                return other
        return tokens

    def _close(self, m: llguidance.LLMatcher, backtrack: int, tokens: list[int],
               reason: str) -> Close | None:
        if backtrack:
            m.rollback(backtrack)
            del self.tokens[len(self.tokens) - backtrack :]
            del self._ends[len(self._ends) - backtrack :]
            del self._text[self._ends[-1] if self._ends else 0 :]
        if tokens and self.accepts is not None:
            tokens = self._accepted(m, tokens)
        if not m.consume_tokens(tokens):
            return None
        self.consumed(tokens)
        self.reason = reason
        return Close(backtrack, tokens, reason)
