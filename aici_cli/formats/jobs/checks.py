"""The checks an input line passes before it is checked against the input-line schema,
cheapest first, each bounding what the next may cost: its size in bytes before it is
decoded, UTF-8, JSON syntax and numbers while it is parsed, nesting depth before any
recursive walk, lone surrogates, and the size of its constraint before the schema check
or the grammar compiler spends time on it.

Each returns the problem (or the BadLine) instead of raising, so that a bad line
becomes that line's error result.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aici_cli.core.job import BadLine
from aici_cli.core.json_text import field_path
from aici_cli.formats.jobs.messages import bad_line, json_syntax_problem, show_bytes

# ---------------------------------------------------------------- bytes and text


def ending_length(raw: str | bytes) -> int:
    """Length of the line ending (LF or CRLF) that `raw` ends with, if any."""
    tail = raw[-2:]
    ending = tail.decode("latin-1") if isinstance(tail, bytes) else tail
    return 2 if ending == "\r\n" else 1 if ending.endswith("\n") else 0


def size_error(raw: str | bytes, index: int, limit: int) -> BadLine | None:
    """Refuse a line over `limit` UTF-8 bytes (line ending excluded) before decoding or
    parsing it, so an oversized line costs no more than having been read."""
    end = len(raw) - ending_length(raw)
    if isinstance(raw, str) and end > limit // 4:
        # A character is 1 to 4 bytes: measure exactly only where the limit is in reach.
        end = len(raw[:end].encode("utf-8", "surrogatepass"))
    if end <= limit:
        return None
    problem = f"line is {end:,} bytes, over the limit of {show_bytes(limit)}"
    return bad_line(index, None, "line_too_large", problem)


def decode_line(raw: str | bytes, index: int) -> str | BadLine:
    """The line as text; bad UTF-8 is this line's error, not the run's."""
    if not isinstance(raw, bytes):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"invalid UTF-8 at byte {exc.start + 1} ({exc.reason})"
        return bad_line(index, None, "invalid_utf8", problem)


# ------------------------------------------------------------------ JSON syntax

# Longest integer literal accepted (Python's own default limit for int(str)): parsing a
# longer one costs quadratic time, and no field takes one.
_MAX_INT_DIGITS = 4300


def _reject_constant(name: str) -> Any:
    """NaN/Infinity are not JSON, and NaN slips through every numeric range check."""
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(literal: str) -> float:
    """`1e400` is valid JSON but overflows to Infinity, which would then be reported as a
    value the user never wrote."""
    value = float(literal)
    if not math.isfinite(value):
        shown = literal if len(literal) <= 40 else literal[:37] + "..."
        raise ValueError(f"number {shown} is out of range for a double")
    return value


def _parse_int(literal: str) -> int:
    """Refuse integers too long to convert, naming the problem in JSON terms."""
    digits = len(literal) - literal.startswith("-")
    if digits > _MAX_INT_DIGITS:
        raise ValueError(
            f"integer with {digits:,} digits, over the limit of {_MAX_INT_DIGITS:,} digits"
        )
    return int(literal)


def load_json(text: str, index: int, max_depth: int) -> Any:
    """Parse one line's JSON; a BadLine (never an exception) when it cannot be."""
    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
        )
    except json.JSONDecodeError as exc:
        return bad_line(index, None, "invalid_json", json_syntax_problem(exc, text))
    except ValueError as exc:  # from the parse_* hooks
        return bad_line(index, None, "invalid_json", f"invalid JSON: {exc}")
    except RecursionError:
        # json's C parser recurses per level and stops near Python's stack limit (about
        # 1000 levels), far beyond `max_depth`.
        problem = f"JSON nested too deeply to parse, over the limit of {max_depth} levels"
        return bad_line(index, None, "too_deep", problem)


# ------------------------------------------------------------------ nesting depth

# A JSON string token, escapes included: written so that a long string is one fast run
# of the character class, not one alternation per character.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _text_depth(text: str) -> int:
    """Nesting depth of valid JSON `text` (0 for a scalar, 1 for `[]` or `{}`).

    Worked out on the text, not on the parsed value: a walk in Python over a line of a
    million small arrays takes seconds, these few whole-text steps take milliseconds.
    Brackets inside strings do not count, so strings go first; what is left is ASCII.
    """
    # Imported here: a tenth of a second of every command that reads these modules
    # (`report` among them), paid only by one that checks a line's depth.
    import numpy as np

    skeleton = _JSON_STRING.sub("", text).encode("ascii", "ignore")
    chars = np.frombuffer(skeleton, dtype=np.uint8)
    steps = np.zeros(len(chars), dtype=np.int8)
    steps[(chars == ord("[")) | (chars == ord("{"))] = 1
    steps[(chars == ord("]")) | (chars == ord("}"))] = -1
    return int(steps.cumsum(dtype=np.int32).max(initial=0))


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests more than `limit` levels; iterative, and it stops at the first
    path that does, since it runs on values known to be too deep."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def depth_problem(obj: Any, text: str, max_depth: int) -> str | None:
    """Describe the line's nesting when it exceeds `max_depth`, naming the top-level
    field that holds it."""
    if text.count("[") + text.count("{") <= max_depth:
        return None  # cannot nest deeper than it has brackets
    depth = _text_depth(text)
    if depth <= max_depth:
        return None
    where = ""
    if isinstance(obj, dict):
        containers = {k: v for k, v in obj.items() if isinstance(v, (dict, list))}
        deep = next((k for k, v in containers.items() if _deeper_than(v, max_depth - 1)), None)
        where = f" in field '{deep}'" if deep is not None else ""
    return f"JSON nested {depth} levels deep{where}, over the limit of {max_depth} levels"


# ------------------------------------------------------------------------ Unicode

# A lone surrogate can enter only as a `\ud800`-style escape (UTF-8 input cannot encode
# one) or, for str input, as the character itself; a valid pair matches too, so a match
# only means the parsed value must be searched.
_SURROGATE_HINT = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _find_surrogate(value: Any, path: tuple[str | int, ...]) -> tuple[str, str] | None:
    """(where, character) of the first lone surrogate in `value`, keys included.

    Recursive, which is safe: the depth was checked first.
    """
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        where = f"field '{field_path(path)}'" if path else "the line"
        return (where, found.group()) if found else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _SURROGATE.search(key)
            if found:
                owner = f"in '{field_path(path)}'" if path else "of the line"
                return (f"a field name {owner}", found.group())
            hit = _find_surrogate(item, (*path, key))
            if hit:
                return hit
    elif isinstance(value, list):
        for i, item in enumerate(value):
            hit = _find_surrogate(item, (*path, i))
            if hit:
                return hit
    return None


def unicode_problem(obj: Any, text: str) -> str | None:
    """A lone surrogate (`"\\ud800"` with no partner) is valid JSON syntax but not
    Unicode: the tokenizer, the grammar compiler and UTF-8 output all choke on it."""
    if not _SURROGATE_HINT.search(text):
        return None
    hit = _find_surrogate(obj, ())
    if hit is None:
        return None
    where, char = hit
    return f"{where} contains a lone surrogate \\u{ord(char):04x}, which is not valid Unicode"


def readable_id(obj: dict[str, Any]) -> str | int | None:
    """The line's own id where results can echo it: a string with no lone surrogate, or
    an integer, kept as given (not a boolean, which JSON tells apart)."""
    raw_id = obj.get("id")
    if isinstance(raw_id, str) and not _SURROGATE.search(raw_id):
        return raw_id
    if isinstance(raw_id, int) and not isinstance(raw_id, bool):
        return raw_id
    return None


# --------------------------------------------------------------- constraint size

_CONSTRAINT_FIELDS = ("json_schema", "regex", "choices", "grammar", "whitespace_pattern",
                      "tools")


def _json_bytes(value: Any) -> int:
    """Size of `value` written as compact JSON in UTF-8: the same whatever the spacing
    of the input line."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def constraint_size_problem(obj: dict[str, Any], limit: int) -> tuple[str, str] | None:
    """(type, problem) when the line's constraint is over `limit` bytes, checked before
    the schema checker or the grammar compiler spends time on it."""
    for name in _CONSTRAINT_FIELDS:
        if name not in obj:
            continue
        size = _json_bytes(obj[name])
        if size > limit:
            type_ = "schema_too_large" if name == "json_schema" else "constraint_too_large"
            problem = (f"field '{name}' is {size:,} bytes as JSON, "
                       f"over the limit of {show_bytes(limit)}")
            return type_, problem
    return None
