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
  of the tokens since, never a cut-off output. Where it holds no plan then (a retry or an
  undo took it back), the last tokens of the budget close from an earlier value boundary
  or the line's first plan (`_rescue`). Only a value whose very first completion does
  not fit `max_tokens` can still end cut off. Tokens taken back (an undo, a retry) are
  not the output's: the budget counts the tokens kept.
- **Loops are undone, then closed from where they began** (`loops.find_loop` on the
  output's text). The loop begins where its unit is written the second time. The first
  loop of a line is taken back to there (one unit kept), and the token the model wrote
  there is *barred* at that position (`barred`; the first position in that unit where the
  grammar allows another token), so the model goes on once more by another way
  (`Undo`, stat `loops_undone`). A loop after that (or one with no other way) is closed
  from where it began: the state there is shallow, so a completion is short and likely
  (reason "loop"); failing that from the plan's position, then from the current one,
  then from the last few value boundaries before the loop (after a `{` or `[`, beside a
  `,`) and the line's first plan (`_rescue`: less kept, but whole). Only where none of
  them has a completion that fits `max_tokens` is the output cut where the loop begins
  and the sequence stopped (reason "loop_unclosable", finish_reason "length": not a
  valid value, but no run on to `max_tokens`).

Cost: a completion walk (a matcher copy and a few token checks per completion token) every
`REPLAN_EVERY` tokens, and at each token near the limit; a walk that finds nothing is not
tried again for `REPLAN_EVERY` tokens (a state with no completion would otherwise cost a
failed walk of up to `WALK_LIMIT` tokens at every token). The loop check is
microseconds; an undo costs a mask per position searched, a close up to three walks.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from aici_cli.control.grammar.close_choice import CloseChoice
from aici_cli.control.grammar.closing import Closer, boundaries
from aici_cli.control.grammar.hints import NO_HINTS, Hints
from aici_cli.control.grammar.keyword_guard import clear_bits
from aici_cli.control.grammar.loops import (
    WINDOW,
    Loop,
    find_loop,
    loop_start,
    second_unit,
    tokens_in,
)

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
# The close reason of a loop neither the current position nor a plan could close: the
# output is cut where the loop begins, and the sequence ends as at the limit ("length").
UNCLOSABLE = "loop_unclosable"
# Loops a line undoes (backtrack, bar, go on) before the next one is closed.
UNDO_LOOPS = 1
# Earlier places a close that found no completion walks from (`_rescue`): the last few
# value boundaries before where it stands, then the line's first plan.
RESCUE_WALKS = 4


@dataclass(frozen=True)
class Closing:
    """What a line may finish early for (`--close-at-limit`, `--loop-guard`), its budget,
    and the run's closer."""

    closer: Closer
    max_tokens: int
    at_limit: bool = True
    loop_guard: bool = True
    undo_loops: int = UNDO_LOOPS


@dataclass(frozen=True)
class Close:
    """A decision to finish now: drop the last `backtrack` tokens, then append `tokens`
    (already consumed by the matcher) and stop. `reason`: "limit", "loop" or
    `UNCLOSABLE` (then `tokens` is empty: the output is cut, not closed)."""

    backtrack: int
    tokens: list[int]
    reason: str


@dataclass(frozen=True)
class Undo:
    """A loop taken back: drop the last `backtrack` tokens (the matcher is rolled back
    already) and go on; the token written next there before is barred (`barred`)."""

    backtrack: int


class EarlyClose:
    """One sequence's closing state; see the module docstring. Sees every token the
    matcher consumes (`consumed`), in order, and decides after each batch of them
    (`decide`)."""

    def __init__(self, closing: Closing, hints: Hints = NO_HINTS,
                 accepts: Callable[[str], bool] | None = None,
                 fault_at: Callable[[bytes], tuple[int, int] | None] | None = None) -> None:
        """`hints`: the schema's, for the completion walk (hints.py). `accepts`: whether a
        whole output is a valid value (the schema's validator), where the grammar does not
        say it all: a close takes the first completion it accepts, if any does.
        `fault_at`: where the first value in an output that breaks a keyword the grammar
        cannot express is mended from, and where it ends (the keyword guard's
        `first_fault`): a close's completion is steered away from it."""
        self.closing = closing
        self.hints = hints
        self.accepts = accepts
        self.fault_at = fault_at
        self.token_bytes = closing.closer.decode_bytes
        # Which completion a close takes where the schema says more than the grammar.
        self._choice = CloseChoice(closing.closer, hints, accepts, fault_at)
        self.tokens: list[int] = []
        self._text = bytearray()  # the output's bytes
        self._ends: list[int] = []  # len(self._text) after each token
        self._plan: tuple[int, list[int]] | None = None  # (position, completion)
        self._first_plan: tuple[int, list[int]] | None = None  # the earliest plan found
        self._rescued_at = -1  # where `_rescue` last found nothing
        self.reason: str | None = None  # set once the sequence was closed early
        self.sampled = False  # the model has written a token (closing waits for one)
        self.loops_undone = 0
        self.undone_tokens = 0  # tokens the loop guard took back (undone or closed from)
        self._bars: dict[int, set[int]] = {}  # position -> tokens barred there
        self._missed = -REPLAN_EVERY  # where a completion walk last found none
        self._checked = 0  # the tokens there were at the last `decide`

    def barred(self) -> set[int]:
        """Tokens the model may not write next: the first of an undone loop, at the
        position where it began (empty almost always)."""
        return self._bars.get(len(self.tokens), set()) if self._bars else set()

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
        self._truncate(keep)
        if self._plan is not None and self._plan[0] > keep:
            self._plan = None
        if self._first_plan is not None and self._first_plan[0] > keep:
            self._first_plan = None
        self._bars = {p: b for p, b in self._bars.items() if p <= keep}

    def _truncate(self, keep: int) -> None:
        self._checked = min(self._checked, keep)
        if self._missed > keep:
            self._missed = -REPLAN_EVERY
        del self.tokens[keep:]
        del self._ends[keep:]
        del self._text[self._ends[-1] if self._ends else 0 :]

    def text(self, tail: int | None = None, upto: int | None = None) -> str:
        """The output decoded: its last `tail` bytes, or its first `upto` tokens'."""
        raw = self._text if tail is None else self._text[-tail:]
        if upto is not None:
            raw = self._text[: self._ends[upto - 1] if upto else 0]
        return bytes(raw).decode("utf-8", "replace")

    def decide(self, m: llguidance.LLMatcher) -> Close | Undo | None:
        """Whether to finish now (a `Close`) or take a loop back (an `Undo`), from `m`,
        the matcher after every token so far. What is returned is already applied to `m`
        (rolled back, completion consumed).

        A loop is looked for after each token consumed since the last call, not only
        after the last: where a step brought several (fast-forward, drafts), one that
        loops and then ends the run (a run of spaces, then its closing quote) is known
        where a step of one token would have known it, so a line's text does not
        depend on how many tokens its steps bring. The decision is then made there, as
        if the tokens after it had not come, and counts them in what it takes back."""
        if m.is_stopped() or m.is_error():
            return None
        later = self._tokens_after_loop()
        if later:
            m.rollback(later)
            taken = self.tokens[len(self.tokens) - later :]
            self.rollback(later)
        decided = self._decide(m)
        self._checked = len(self.tokens)
        if not later:
            return decided
        if decided is None:  # not expected with a loop found; the tokens stand, as they came
            if not m.consume_tokens(taken):
                raise RuntimeError("the grammar refused tokens it had accepted")
            self.consumed(taken)
            self._checked = len(self.tokens)
            return None
        if isinstance(decided, Undo):
            return Undo(decided.backtrack + later)
        return Close(decided.backtrack + later, decided.tokens, decided.reason)

    def _tokens_after_loop(self) -> int:
        """How many of the tokens consumed since the last `decide` come after the first
        one the output loops at (0: it loops at none before the last)."""
        if not self.closing.loop_guard:
            return 0
        n = len(self.tokens)
        for at in range(max(1, self._checked + 1), n):
            end = self._ends[at - 1]
            tail = bytes(self._text[max(0, end - 4 * WINDOW) : end]).decode("utf-8", "replace")
            if find_loop(tail) is not None:
                return n - at
        return 0

    def _decide(self, m: llguidance.LLMatcher) -> Close | Undo | None:
        """`decide` with the output as it stands."""
        c = self.closing
        pos = len(self.tokens)
        left = c.max_tokens - pos
        tail = self.text(tail=4 * WINDOW) if c.loop_guard else ""
        loop = find_loop(tail) if c.loop_guard else None
        if m.is_accepting():  # a whole value (`1.1` of a number) that may go on looping
            return self._end_whole(m, tail, loop) if loop is not None else None
        if loop is not None:
            return self._end_loop(m, left, tail, loop)
        if not c.at_limit:
            return None
        plan = self._plan
        near = plan is not None and left <= len(plan[1]) + NEAR
        if plan is not None and not near and pos - plan[0] < REPLAN_EVERY:
            return None
        if not near and left > NEAR and pos - self._missed < REPLAN_EVERY:
            return None
        done = self._complete(m, left)
        if done is None:
            self._missed = pos
        else:
            self._plan = (pos, done)
            if self._first_plan is None:
                self._first_plan = self._plan
            # Not before the model's first token (at `start`, after the grammar's forced
            # opening): a line then takes at least one pass, so its logprobs are read, and
            # the plan still holds if that token does not fit.
            if left - len(done) <= MARGIN and self.sampled:
                return self._close(m, 0, done, "limit")
            return None
        if plan is not None and near:  # no way on from here fits: back to the plan
            m.rollback(pos - plan[0])
            self._truncate(plan[0])
            return self._close(m, pos - plan[0], plan[1], "limit")
        if left <= MARGIN and self.sampled and self._rescued_at != pos:
            # No plan (a retry or an undo took it back), no way on: close from earlier.
            return self._rescue(m, pos, "limit")
        return None

    def _end_loop(self, m: llguidance.LLMatcher, left: int, tail: str,
                  loop: Loop) -> Close | Undo | None:
        """`tail` (the output's last bytes, decoded) ends in `loop`: undo it (the first
        `undo_loops` times), or close the value from where the loop began, from the
        plan, or from here, or else cut the output where the loop begins."""
        n = len(self.tokens)
        begun = loop_start(self._text, tail, loop)
        first = min(second_unit(self._ends, begun, tail, loop), n - 1)
        if self.loops_undone < self.closing.undo_loops:
            unit_end = min(n - 1, first + max(1, tokens_in(self._ends, first, loop)))
            at = self._first_choice(m, first, unit_end)
            if at is not None:
                self.loops_undone += 1
                self.undone_tokens += n - at
                return Undo(n - at)
        keep = bisect_right(self._ends, begun)
        plan = self._plan
        for pos in dict.fromkeys([first, *([plan[0]] if plan else []), n]):
            if pos > n:
                continue
            if pos == n or pos == (plan[0] if plan else -1):
                done = self._plan_or_walk(m, pos, left + n - pos)
            else:
                done = self._walk_from(m, pos, left + n - pos)
            if done is not None:
                self.undone_tokens += n - pos
                return self._close(m, n - pos, done, "loop")
        rescued = self._rescue(m, first, "loop")
        if rescued is not None:
            self.undone_tokens += rescued.backtrack
            return rescued
        self.undone_tokens += n - keep
        m.rollback(n - keep)
        self._truncate(keep)
        return self._close(m, n - keep, [], UNCLOSABLE)

    def _rescue(self, m: llguidance.LLMatcher, before: int, reason: str) -> Close | None:
        """A close from the last `RESCUE_WALKS` value boundaries before `before`, then the
        first plan (or the start): less kept, but whole; None (nothing changed) if none."""
        n, first = len(self.tokens), self._first_plan
        at_end = {end: p + 1 for p, end in enumerate(self._ends[:before])}
        places = [at_end[b] for b in boundaries(bytes(self._text[: self._ends[before - 1]]))
                  if b in at_end] if before else []
        floor = first[0] if first is not None else 0
        later = [p for p in dict.fromkeys(reversed(places)) if p > floor][:RESCUE_WALKS]
        for pos in [*later, floor] if floor < n else later:
            if pos == floor and first is not None:  # the first plan's own completion
                m.rollback(n - pos)
                self._truncate(pos)
            done = first[1] if pos == floor and first is not None else self._walk_from(
                m, pos, self.closing.max_tokens - pos)
            if done is not None:
                return self._close(m, n - pos, done, reason)
        self._rescued_at = n
        return None

    def _end_whole(self, m: llguidance.LLMatcher, tail: str, loop: Loop) -> Close | None:
        """A whole value loops on (`1.1000…`): it ends at its loop's second unit, or here."""
        n = len(self.tokens)
        first = min(second_unit(self._ends, loop_start(self._text, tail, loop), tail, loop), n)
        m.rollback(n - first)
        if first == n or not m.is_accepting():
            m.consume_tokens(self.tokens[first:])  # accepted before: cannot fail
            first = n
        self._truncate(first)
        self.undone_tokens += n - first
        return self._close(m, n - first, [], "loop")

    def _plan_or_walk(self, m: llguidance.LLMatcher, pos: int, left: int) -> list[int] | None:
        """A completion from `pos`: the plan's where it was made there, else a walk."""
        plan = self._plan
        if plan is not None and plan[0] == pos and pos < len(self.tokens):
            m.rollback(len(self.tokens) - pos)
            self._truncate(pos)
            return plan[1]
        return self._walk_from(m, pos, left)

    def _walk_from(self, m: llguidance.LLMatcher, pos: int, left: int) -> list[int] | None:
        """A completion walked from position `pos` (<= the tokens so far) within `left`
        tokens: on success `m` and this state are left at `pos`; else both unchanged."""
        n = len(self.tokens)
        if pos < n:
            m.rollback(n - pos)
        done = self.closing.closer.completion(
            m, self.text(upto=pos), min(left, WALK_LIMIT), self.hints) or None
        if done is None:
            if pos < n:
                m.consume_tokens(self.tokens[pos:])  # accepted before: cannot fail
            return None
        self._truncate(pos)
        return done

    def _first_choice(self, m: llguidance.LLMatcher, first: int, last: int) -> int | None:
        """The first position in [first, last] where the grammar allows a token other
        than the one written there: `m` is rolled back to it, the written token barred
        there and this state cut to it. None (and `m`, this state unchanged) if none."""
        n = len(self.tokens)
        m.rollback(n - first)
        for at in range(first, n):
            if at <= last and _other_allowed(m, self.tokens[at]):
                self._bars.setdefault(at, set()).add(self.tokens[at])
                self._truncate(at)
                if self._plan is not None and self._plan[0] > at:
                    self._plan = None
                return at
            m.consume_token(self.tokens[at])  # accepted before: cannot fail
        return None

    def _complete(self, m: llguidance.LLMatcher, left: int) -> list[int] | None:
        done = self.closing.closer.completion(m, self.text(), min(left, WALK_LIMIT),
                                              self.hints)
        return done if done else None

    def _close(self, m: llguidance.LLMatcher, backtrack: int, tokens: list[int],
               reason: str) -> Close | None:
        """Finish with `tokens` after `backtrack` tokens taken back (from `m` and this
        state already)."""
        if tokens and self.accepts is not None:
            left = min(self.closing.max_tokens - len(self.tokens), WALK_LIMIT)
            tokens = self._choice.accepted(m, bytes(self._text), left, tokens)
        if tokens and not m.consume_tokens(tokens):
            return None
        self.consumed(tokens)
        self.reason = reason
        return Close(backtrack, tokens, reason)


def _other_allowed(m: llguidance.LLMatcher, written: int) -> bool:
    """Whether the grammar allows, where `m` stands, a token other than `written`."""
    words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32).copy()
    clear_bits(words, {written})
    return bool(words.any())

