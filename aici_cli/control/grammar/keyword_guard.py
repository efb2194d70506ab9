"""Holding an output to the schema keywords its grammar cannot express, as it is written.

A JSON-schema line whose schema has a keyword of keyword_schema.py's `CHECKED` gets a
`KeywordGuard`. It reads every token the matcher consumes (`consumed`), follows the
JSON text with a `JsonScanner`, and at each value's end checks it against the keywords
that apply at its path (`KeywordSchema.checks`, on the schema as written):

- an array item that repeats an earlier one, under `uniqueItems`, and a member past
  `maxProperties`, as soon as the item or member ends;
- every checked keyword on a whole value when it ends (`minProperties`,
  `dependentRequired` at an object's `}`; `not`, `oneOf`, `if`/`then`/`else`).

A value that breaks one is taken back to a *choice point* and the token the model chose
there is *barred*: it may not be chosen at that position again (`barred`), so the model
chooses again. The choice point is the first position, from where the fault can be
mended, at which the grammar allows another token than the one written: from the comma
before a member past `maxProperties` (the model must close the object), from a
container's closing bracket (it must write another member), from a repeated item's or a
scalar's first byte (the first of its tokens that was a choice: a string's quote is
forced, its first letters are not). Where the grammar allows nothing else up to the end of
the value, the check is given up and the output stays as written (`valid: false`).

A tool-call line whose tools' `parameters` have such keywords gets a `CallKeywordGuard`:
the same checks on each call's `arguments`, against the schema of the tool the call names
(`CallScanner` follows the JSON of each call and skips the text around it).

Bounds: at most `MAX_RETRIES` faults are acted on per line; after that the guard only
records text. Cost: a decode and a scan of each token's bytes (microseconds), a cached
path lookup at each value's end, and a jsonschema check (and a parse of the value) only
where a keyword applies; a fault costs a matcher mask per position searched.
"""

from __future__ import annotations

import copy
import json
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from aici_cli.control import tool_calls
from aici_cli.control.grammar.json_scan import JsonScanner, Step, ValueEnd
from aici_cli.control.grammar.keyword_schema import KeywordSchema, first_byte_type

# Faults acted on per line (bars applied, or checks given up): each costs a backtrack and
# the tokens rewritten; a model that keeps breaking a keyword ends `valid: false` instead
# of spending its budget on retries.
MAX_RETRIES = 8
_OBJECT = ord("{")


@dataclass(frozen=True)
class Fault:
    """A value that breaks a checked keyword: mend it at the first choice between bytes
    `mend_from` and `until` (the value's end), else at the first between `start` (the
    value's first byte) and `mend_from`; `keyword` names what it broke."""

    mend_from: int
    until: int
    keyword: str
    start: int = -1  # -1: no earlier place to mend it


class KeywordGuard:
    """One sequence's check of the checked keywords; see the module docstring."""

    def __init__(self, schema: KeywordSchema, validator: Any,
                 decode: Callable[[list[int]], bytes]) -> None:
        """`validator`: the jsonschema validator of the schema as written (its `$ref`s
        resolve against it); `decode`: a token list to its exact bytes."""
        self.schema = schema
        self.validator = validator
        self.decode = decode
        self.tokens: list[int] = []
        self.ends: list[int] = []  # bytes of output after each token
        self.scanner = self.new_scanner()
        self.bars: dict[int, set[int]] = {}  # position -> tokens barred there
        self.retries = 0  # faults acted on (<= MAX_RETRIES)
        self.barred_count = 0  # bars applied: the `keyword_retries` stat
        self.last_fault: Fault | None = None
        self.gave_up = 0  # faults with no choice left to bar: the grammar forced them

    def new_scanner(self) -> JsonScanner:
        return JsonScanner()

    def route(self, path: tuple[Step, ...]) -> tuple[KeywordSchema, Any, tuple[Step, ...]] | None:
        """The keyword schema and validator that hold at `path`, and the path within it."""
        return self.schema, self.validator, path

    def barred(self) -> set[int]:
        """Tokens the model may not choose next (empty almost always)."""
        return self.bars.get(len(self.tokens), set()) if self.bars else set()

    def consumed(self, tokens: Sequence[int]) -> Fault | None:
        """`tokens` were consumed by the matcher: the first fault they complete, if any."""
        fault = None
        for t in tokens:
            data = self.decode([t])
            self.tokens.append(t)
            self.ends.append((self.ends[-1] if self.ends else 0) + len(data))
            for end in self.scanner.feed(data):
                if fault is None and self.retries < MAX_RETRIES:
                    fault = self._check(end)
        return fault

    def mend(self, m: llguidance.LLMatcher, fault: Fault) -> int:
        """Take `m` (which has consumed exactly `self.tokens`) back to the first choice
        point at or after the fault's first byte, and bar the token written there. Returns the
        tokens taken back; 0 when no choice point is found (the check is given up, `m`
        unchanged)."""
        self.retries += 1
        self.last_fault = fault
        # An object closed where the grammar allows nothing but `}` (llguidance keeps the
        # schema's property order: after the last property, no member can follow) is
        # mended where its members were chosen: from its first member.
        # There, a choice whose only other way closes the container at once (`{}`) is
        # passed over: the members it drops are what the keyword asked for.
        for begin, stop, emptying in ((fault.mend_from, fault.until, True),
                                      (fault.start, fault.mend_from, False)):
            if begin >= 0 and begin < stop:
                taken = self._mend_between(m, begin, stop, emptying)
                if taken:
                    return taken
        self.gave_up += 1
        return 0

    def _mend_between(self, m: llguidance.LLMatcher, begin: int, stop: int,
                      emptying: bool = True) -> int:
        """Take `m` back to the first choice point among the tokens holding bytes `begin`
        .. `stop - 1` and bar the token written there; the tokens taken back, or 0 (and
        `m` as it was). `emptying` False: not at a choice whose other ways all close
        the value."""
        n = len(self.tokens)
        first = bisect_right(self.ends, begin)  # the token holding that byte
        last = min(n - 1, bisect_right(self.ends, stop - 1))  # and the range's last
        if first > last:
            return 0
        m.rollback(n - first)
        for at in range(first, n):
            if at <= last and self._other_allowed(m, at, emptying):
                self._cut(at)
                return n - at
            if not m.consume_token(self.tokens[at]):  # it was accepted before: cannot fail
                break
        return 0

    def _other_allowed(self, m: llguidance.LLMatcher, at: int, emptying: bool = True) -> bool:
        """Whether, at position `at`, the grammar allows a token that is neither the one
        written there nor one barred there (with `emptying` False: one that does not
        begin with a closing bracket; the allowed set is then read token by token, few
        where it matters)."""
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32).copy()
        clear_bits(words, {self.tokens[at], *self.bars.get(at, ())})
        if emptying or not words.any():
            return bool(words.any())
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        others = np.flatnonzero(bits)
        if len(others) > 8:  # many ways on: some of them keep the members
            return True
        return any(not self.decode([int(t)]).lstrip().startswith((b"}", b"]"))
                   for t in others)

    def _cut(self, at: int) -> None:
        """Keep the first `at` tokens; bar the one that was at `at` there."""
        token = self.tokens[at]
        self.rollback(len(self.tokens) - at)
        self.bars.setdefault(at, set()).add(token)
        self.barred_count += 1

    def first_fault(self, text: bytes) -> tuple[int, int] | None:
        """The first value in `text` (a whole output) that breaks a checked keyword, as
        (the first byte to mend it from, the byte after its end); None where none does:
        how a close's completion is checked before it is taken (early_close.py). This
        guard's own state is unchanged; costs a scan of `text` and a check per value end."""
        probe = copy.copy(self)
        probe.scanner = self.new_scanner()
        for end in probe.scanner.feed(text):
            fault = probe._check(end)
            if fault is not None:
                return fault.mend_from, fault.until
        return None

    def rollback(self, n: int) -> None:
        """Take back the last `n` tokens (also where someone else took them back). Bars
        past the new end are dropped: what follows is written afresh."""
        if not n:
            return
        keep = len(self.tokens) - n
        del self.tokens[keep:]
        del self.ends[keep:]
        self.bars = {p: b for p, b in self.bars.items() if p <= keep}
        kept = bytes(self.scanner.text[: self.ends[-1] if self.ends else 0])
        self.scanner = self.new_scanner()  # the kept text was checked already: scanned only
        self.scanner.feed(kept)

    def _check(self, end: ValueEnd) -> Fault | None:
        """The fault `end` completes: its parent's items or members so far, then the
        value itself."""
        text = self.scanner.text
        parent = self.route(end.path[:-1]) if end.parent_start >= 0 else None
        if parent is not None:
            parent_kind = "object" if text[end.parent_start] == _OBJECT else "array"
            schema, validator, path = parent
            for check in schema.checks(path, parent_kind):
                fault = self._prefix_fault(check, end, parent_kind, validator)
                if fault is not None:
                    return fault
        here = self.route(end.path)
        if here is None:
            return None
        schema, validator, path = here
        checks = schema.checks(path, first_byte_type(end.kind))
        if not checks:
            return None
        value = json.loads(bytes(text[end.start : end.end]))
        for check in checks:
            if not validator.evolve(schema=check).is_valid(value):
                # A container is mended from its closing bracket (write more, or
                # other members), else from its first member; a scalar from its first
                # byte.
                if end.kind in b"{[":
                    return Fault(end.end - 1, end.end, ",".join(sorted(check)),
                                 end.start + 1)
                return Fault(end.start, end.end, ",".join(sorted(check)))
        return None

    def _prefix_fault(self, check: dict[str, Any], end: ValueEnd, parent_kind: str,
                      validator: Any) -> Fault | None:
        """A new item equal to an earlier one (`uniqueItems`), or the member one past
        `maxProperties`: the parent's contents so far suffice to tell."""
        most = check.get("maxProperties")
        if parent_kind == "object" and isinstance(most, int) and end.count == most + 1:
            return Fault(end.separator if end.separator >= 0 else end.member_start,
                         end.end, "maxProperties")
        if parent_kind == "array" and check.get("uniqueItems") is True and end.count > 1:
            items = json.loads(bytes(self.scanner.text[end.parent_start : end.end]) + b"]")
            unique = validator.evolve(schema={"uniqueItems": True}).is_valid
            # Only a new repeat: one an earlier check gave up on is not counted again.
            if not unique(items) and unique(items[:-1]):
                return Fault(end.member_start, end.end, "uniqueItems")
        return None


class CallScanner(JsonScanner):
    """A `JsonScanner` over a tool-call output (tool_calls.py): it follows the JSON object
    of each call (`{"name": ..., "arguments": {...}}`) and skips the text around them,
    keeping every byte in `text` so that offsets are the output's. `name`: the tool the
    call being written names, once its name has ended (kept until the next call's name
    ends: the text between a call's arguments and the next call's name is longer than a
    token, so the values a token ends are all in one call)."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None
        self._outside = True  # between calls: waiting for a call's opening tag, then `{`
        self._tagged = False

    def feed(self, data: bytes) -> list[ValueEnd]:
        ended: list[ValueEnd] = []
        for i, b in enumerate(data):
            if self._outside:
                self.text.append(b)
                self._wait(b)
                continue
            for end in super().feed(data[i : i + 1]):
                ended.append(end)
                if end.path == ("name",):
                    self.name = json.loads(bytes(self.text[end.start : end.end]))
                if end.parent_start < 0:  # the call's object closed
                    self._outside, self._tagged = True, False
        return ended

    def _wait(self, b: int) -> None:
        if not self._tagged:
            self._tagged = self.text.endswith(_CALL_OPEN)
        elif b == _OBJECT:  # the call's object begins: scanned from its bracket on
            self._outside = False
            del self.text[-1]
            super().feed(bytes([b]))


_CALL_OPEN = tool_calls.OPEN.encode()


class CallKeywordGuard(KeywordGuard):
    """The keyword guard of a tool-call line: each call's `arguments` are held to the
    keywords of the tool it names (`keywords`, by tool name; `validators`, each tool's
    `parameters` as written)."""

    def __init__(self, keywords: dict[str, KeywordSchema], validators: dict[str, Any],
                 decode: Callable[[list[int]], bytes]) -> None:
        self.keywords = keywords
        self.validators = validators
        super().__init__(next(iter(keywords.values())), None, decode)

    def new_scanner(self) -> JsonScanner:
        return CallScanner()

    def route(self, path: tuple[Step, ...]) -> tuple[KeywordSchema, Any, tuple[Step, ...]] | None:
        name = self.scanner.name if isinstance(self.scanner, CallScanner) else None
        if not path or path[0] != "arguments" or name not in self.keywords:
            return None
        return self.keywords[name], self.validators[name], path[1:]


def clear_bits(words: np.ndarray, tokens: set[int]) -> None:
    """Clear `tokens`' bits in a token bitmask (uint32 words, bit t = token t)."""
    for t in tokens:
        if (t >> 5) < words.size:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
