"""Short texts a schema's values take, for the closer (closing.py) to try where its token
list cannot finish a value.

Two kinds, both read off the schema once, when it compiles:

- **String samples**: a shortest string matching each `pattern` (read with Python's own
  regex parser) and a fixed example of each `format` llguidance checks. A string such
  as `\\d+\\.\\d+\\.\\d+-?.*` (unanchored: the version number may sit anywhere) or
  `^iglu:[a-z]+/[a-z]+/[0-9]+-[0-9]+-[0-9]+$` closes only after a run of particular
  characters, which no fixed order of closing tokens writes.
- **Required keys**: the names in every `required` list. Where an object cannot close
  yet, the shortest way on is the next required key; the grammar takes every property
  in schema order, so writing the lowest-numbered allowed key walks through all the
  optional ones first (hundreds in the WashingtonPost schemas).

A hint is only a candidate: the closer takes it where the matcher validates it, so a
sample from the wrong subschema, or a regex Python reads differently, costs one check.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aici_cli.control.grammar.schema_walk import walk

if TYPE_CHECKING:
    from aici_cli.control.grammar.distinct_keys import TokenIndex

# The parser behind `re` (`re._parser` from Python 3.11, `sre_parse` before): private,
# so every use is guarded, and a pattern it cannot read gets no sample.
_NEW = sys.version_info >= (3, 11)
_sre: Any = importlib.import_module("re._parser" if _NEW else "sre_parse")
_c: Any = importlib.import_module("re._constants" if _NEW else "sre_constants")

# A sample per `format` llguidance enforces (the others are not in the grammar).
FORMAT_SAMPLES = {
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
    "duration": "P1D", "email": "a@a.aa", "idn-email": "a@a.aa", "hostname": "a",
    "idn-hostname": "a", "ipv4": "0.0.0.0", "ipv6": "::1",
    "uuid": "00000000-0000-0000-0000-000000000000", "uri": "a:a", "iri": "a:a",
    "uri-reference": "a", "iri-reference": "a",
}
# Bounds on what one schema hands the closer: each hint costs a check where it is tried.
MAX_SAMPLES = 32
MAX_KEYS = 256
# The longest sample kept (characters): a longer one is no short way to close.
MAX_SAMPLE_CHARS = 64


@dataclass(frozen=True)
class Hints:
    """`strings`: JSON-escaped string contents (no quotes), shortest first; `keys`: the
    required property names, JSON-escaped, in the order the schema lists them;
    `distinct_keys`: where the schema's objects may hold undeclared keys, the vocabulary
    by bytes, so that a completion writes no key twice in an object (distinct_keys.py)."""

    strings: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    distinct_keys: TokenIndex | None = None


NO_HINTS = Hints()


def hints_for(schema: Any) -> Hints:
    """The hints of a JSON schema (any value: a bad schema has none)."""
    samples: dict[str, None] = {}
    keys: dict[str, None] = {}
    for node in walk(schema):
        s = node.node
        if not isinstance(s, dict):
            continue
        pattern = s.get("pattern")
        if isinstance(pattern, str):
            sample = shortest_match(pattern)
            if sample is not None and len(sample) <= MAX_SAMPLE_CHARS:
                samples.setdefault(_escaped(sample))
        fmt = s.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_SAMPLES:
            samples.setdefault(FORMAT_SAMPLES[fmt])
        required = s.get("required")
        if isinstance(required, list):
            for name in required:
                if isinstance(name, str):
                    keys.setdefault(_escaped(name))
    strings = sorted(samples, key=len)[:MAX_SAMPLES]
    return Hints(tuple(strings), tuple(list(keys)[:MAX_KEYS]))


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]


def shortest_match(pattern: str) -> str | None:
    """A shortest string `pattern` matches (anchors and lookarounds read as empty), or
    None where Python cannot read the pattern or it has what this does not build."""
    pattern = re.sub(r"\(\?<(?![=!])", "(?P<", pattern)  # ECMA's named groups
    try:
        parsed = _sre.parse(pattern)
    except (re.error, ValueError, OverflowError, RecursionError):
        return None
    try:
        return _build(list(parsed), {})
    except (_Unsupported, RecursionError):
        return None


class _Unsupported(Exception):
    pass


# What a character class gives, by category.
_CATEGORY = {
    _c.CATEGORY_DIGIT: "0", _c.CATEGORY_NOT_DIGIT: "a", _c.CATEGORY_WORD: "a",
    _c.CATEGORY_NOT_WORD: " ", _c.CATEGORY_SPACE: " ", _c.CATEGORY_NOT_SPACE: "a",
}
# Characters tried for a negated class, in order.
_ANY_OF = "a0A_- .x"


def _build(items: list[Any], groups: dict[int, str]) -> str:
    return "".join(_one(op, av, groups) for op, av in items)


def _one(op: Any, av: Any, groups: dict[int, str]) -> str:
    if op is _c.LITERAL:
        return chr(av)
    if op is _c.NOT_LITERAL:
        return next(ch for ch in _ANY_OF if ord(ch) != av)
    if op is _c.ANY:
        return "a"
    if op is _c.AT or op in (_c.ASSERT, _c.ASSERT_NOT):
        return ""
    if op is _c.IN:
        return _in_class(av)
    if op is _c.CATEGORY:
        return _CATEGORY.get(av, "a")
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        low, _high, sub = av
        return _build(list(sub), groups) * low if low else ""
    if op is _c.SUBPATTERN:
        group, _add, _del, sub = av
        text = _build(list(sub), groups)
        if group is not None:
            groups[group] = text
        return text
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return _build(list(av), groups)
    if op is _c.BRANCH:
        return min((_build(list(alt), dict(groups)) for alt in av[1]), key=len)
    if op is _c.GROUPREF:
        return groups.get(av, "")
    raise _Unsupported(op)


def _in_class(items: list[Any]) -> str:
    if items and items[0][0] is _c.NEGATE:
        rest = items[1:]
        for ch in _ANY_OF:
            if not any(_class_has(op, av, ch) for op, av in rest):
                return ch
        raise _Unsupported("negated class")
    for op, av in items:
        if op is _c.LITERAL:
            return chr(av)
        if op is _c.RANGE:
            low, high = av
            return next((ch for ch in "0aA" if low <= ord(ch) <= high), chr(low))
        if op is _c.CATEGORY:
            return _CATEGORY.get(av, "a")
    raise _Unsupported("class")


def _class_has(op: Any, av: Any, ch: str) -> bool:
    if op is _c.LITERAL:
        return ord(ch) == av
    if op is _c.RANGE:
        return bool(av[0] <= ord(ch) <= av[1])
    if op is _c.CATEGORY:
        return re.fullmatch(_CATEGORY_RE.get(av, "(?!)"), ch) is not None
    return False


_CATEGORY_RE = {
    _c.CATEGORY_DIGIT: r"\d", _c.CATEGORY_NOT_DIGIT: r"\D", _c.CATEGORY_WORD: r"\w",
    _c.CATEGORY_NOT_WORD: r"\W", _c.CATEGORY_SPACE: r"\s", _c.CATEGORY_NOT_SPACE: r"\S",
}
