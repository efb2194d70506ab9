"""No key twice in one object: the bar on a token that would finish a key already written.

llguidance writes each declared property at most once, but the keys beyond them (under
`additionalProperties`, `patternProperties`, or an object with no `properties`) are
free, and where it holds `minProperties` itself it counts members: `{"id": null, "id":
null, ...}` passed a `minProperties: 6`, while every validator sees one key (RFC 8259:
names SHOULD be unique). `DistinctKeys` follows the output's JSON (`JsonScanner`, whose
open objects keep their keys) and bars each token whose bytes begin with what would
finish a key the innermost object already holds:

- inside a key: the rest of such a key and its closing quote;
- where the object wants a key (after `{` or `,`): such a key whole, with its quotes;
- after a value (or inside a string value): `,`, the separator's space, and such a key.

So `minProperties`, `maxProperties` and `required` count distinct keys. The bars are
*soft*: where they would leave no token (a `patternProperties` that admits one key only),
the controller drops them and the grammar decides alone (`fill_mask`). Where the grammar
forced a repeated key's end (a key pattern of at most three letters forces the quote
after "ccc"), the key is taken back to its last token that was a choice, and that token
barred there (`mend`, at most `MAX_MENDS` a line).

Keys are compared as written (their JSON text): one key escaped two ways is not caught.

Cost: the vocabulary sorted by bytes once per model (`TokenIndex`: ~50 ms at 49k tokens,
built the first time a schema needs it); per token, a scan of its bytes; per position in
an object that holds keys, a bisection per key (microseconds). Only schemas whose objects
may hold undeclared keys get the check (`may_repeat_keys`).
"""

from __future__ import annotations

import copy
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np

from aici_cli.control.grammar.json_scan import JsonScanner
from aici_cli.control.grammar.keyword_guard import clear_bits
from aici_cli.control.grammar.schema_walk import walk

_OBJECT = ord("{")
# Repeated keys a line takes back (the grammar forced their end) before it lets one stand.
MAX_MENDS = 8
# What an object's keys are, as opposed to a value's: a node with one of these is an object
# schema even without `type`.
_OBJECT_WORDS = ("properties", "additionalProperties", "patternProperties", "required",
                 "minProperties", "maxProperties", "propertyNames")
# A node with one of these and no object words stands for other schemas (walked too).
_ELSEWHERE = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")


class TokenIndex:
    """A vocabulary sorted by its tokens' bytes: the tokens that begin with given bytes,
    by bisection."""

    def __init__(self, decode: Callable[[list[int]], bytes], vocab_size: int) -> None:
        pairs = sorted((decode([t]), t) for t in range(vocab_size))
        self._bytes = [b for b, _ in pairs]
        self._ids = [t for _, t in pairs]

    def starting_with(self, prefix: bytes) -> list[int]:
        """The tokens whose bytes begin with `prefix` (not empty)."""
        at = bisect_left(self._bytes, prefix)
        found = []
        while at < len(self._bytes) and self._bytes[at].startswith(prefix):
            found.append(self._ids[at])
            at += 1
        return found


def may_repeat_keys(schema: Any) -> bool:
    """Whether a value of `schema` (as compiled: closed objects say
    `additionalProperties: false`) may hold an object with a key it does not declare:
    some subschema admits objects and leaves their other keys open."""
    for item in walk(schema):
        node = item.node
        if node is True:
            return True
        if not isinstance(node, dict) or node.get("additionalProperties", True) is False:
            if isinstance(node, dict) and node.get("patternProperties"):
                return True
            continue
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if isinstance(types, list) and "object" not in types:
            continue
        if types is None and not any(k in node for k in _OBJECT_WORDS) and any(
                k in node for k in _ELSEWHERE):
            continue
        return True
    return False


class DistinctKeys:
    """One sequence's bar on repeated keys; see the module docstring. Sees every token the
    matcher consumes (`consumed`), in order, and each take-back (`rollback`)."""

    def __init__(self, index: TokenIndex, decode: Callable[[list[int]], bytes]) -> None:
        self.index = index
        self.decode = decode
        self.scanner = JsonScanner()
        self.tokens: list[int] = []
        self.ends: list[int] = []  # bytes of output after each token
        self._cached: tuple[int, set[int]] = (-1, set())  # (position, its bars)
        self.bars: dict[int, set[int]] = {}  # position -> tokens a mend barred there
        self.mends = 0

    @classmethod
    def after(cls, index: TokenIndex, decode: Callable[[list[int]], bytes],
              text: str) -> DistinctKeys:
        """A tracker that has read `text` (a completion walk's start, closing.py)."""
        keys = cls(index, decode)
        keys.scanner.feed(text.encode("utf-8"))
        return keys

    def fits(self, run: Sequence[int]) -> bool:
        """Whether `run`, written from here, writes no key twice (this state unchanged)."""
        trial = DistinctKeys(self.index, self.decode)
        trial.scanner = copy.deepcopy(self.scanner)
        trial.ends = list(self.ends)
        trial.tokens = list(self.tokens)
        for t in run:
            if t in trial.barred():
                return False
            trial.consumed([t])
        return True

    def consumed(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.scanner.feed(self.decode([t]))
            self.ends.append(len(self.scanner.text))
            self.tokens.append(t)

    def rollback(self, n: int) -> None:
        """Take back the last `n` tokens: the kept text is scanned again. Bars past the
        new end are dropped: what follows is written afresh."""
        if not n:
            return
        keep = len(self.ends) - n
        del self.ends[keep:]
        del self.tokens[keep:]
        kept = bytes(self.scanner.text[: self.ends[-1] if self.ends else 0])
        self.scanner = JsonScanner()
        self.scanner.feed(kept)
        self.bars = {p: b for p, b in self.bars.items() if p <= keep}
        self._cached = (-1, set())  # a position may be reached again with other text

    def barred(self) -> set[int]:
        """The tokens that would finish a key the object being written holds already,
        and those a mend barred here (empty almost always); computed once a position."""
        at, bars = self._cached
        if at != len(self.ends):
            bars = set(self.bars.get(len(self.ends), ()))
            for finish in self._finishing():
                bars.update(self.index.starting_with(finish))
            self._cached = (len(self.ends), bars)
        return bars

    def mend(self, m: llguidance.LLMatcher) -> int:
        """Where the grammar forced a repeated key's end (a key pattern of at most three
        letters, after "ccc", forces its quote): take `m`, which has consumed this
        state's tokens, back to the key's last token that was a choice and bar it
        there. Returns the tokens taken back; 0 where no key was repeated, none was a
        choice, or `MAX_MENDS` were made."""
        start = self.scanner.repeated_key
        if start < 0 or self.mends >= MAX_MENDS:
            return 0
        self.scanner.repeated_key = -1
        self.mends += 1
        n, tokens = len(self.ends), list(self.tokens)
        first = bisect_right(self.ends, start)  # the token holding the key's quote
        for at in range(n - 1, first - 1, -1):
            m.rollback(1)
            words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32).copy()
            clear_bits(words, {tokens[at], *self.bars.get(at, ())})
            if words.any():
                self.rollback(n - at)
                self.bars.setdefault(at, set()).add(tokens[at])
                return n - at
        m.consume_tokens(list(tokens[first:n]))  # accepted before: cannot fail
        return 0

    def _finishing(self) -> list[bytes]:
        """What would finish a repeated key from here, each as the bytes that begin a
        token that writes it."""
        sc = self.scanner
        top = sc.stack[-1] if sc.stack else None
        if top is None or top.kind != _OBJECT or not top.keys:
            return []
        written = sc.open_key()
        if written is not None:
            return [k[len(written):] + b'"' for k in top.keys if k.startswith(written)]
        if top.wants_key:
            return [q + b'"' + k + b'"' for k in top.keys for q in (b"", b" ")]
        before = b'"' if sc.in_string() else b""
        return [before + sep + b'"' + k + b'"' for k in top.keys for sep in (b", ", b",")]
