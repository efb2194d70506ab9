"""The one-line problem text of a `BadLine`: `line N: ` and what is wrong, naming the
field and the offending value, whether it came from jsonschema or from the JSON parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from jsonschema.exceptions import ValidationError

from aici_cli.core.config import MIB
from aici_cli.core.job import BadLine
from aici_cli.core.json_text import field_path, show
from aici_cli.core.suggest import did_you_mean

# Longest text of one problem in a message: values are quoted in messages, and a value
# can be megabytes long; a message must stay a readable single line.
_MAX_PROBLEM_CHARS = 500


def _one_line(problem: str) -> str:
    """Collapse line breaks and cut to `_MAX_PROBLEM_CHARS`: a message is one log line."""
    text = re.sub(r"\s*[\r\n\x0b\x0c\x1c-\x1e\x85\u2028\u2029]+\s*", " ", problem)
    if len(text) <= _MAX_PROBLEM_CHARS:
        return text
    return text[: _MAX_PROBLEM_CHARS - 3] + "..."


def bad_line(index: int, id_: str | int | None, type_: str, problem: str) -> BadLine:
    """Every message starts with `line N: ` so it reads well on its own in a log."""
    return BadLine(
        index=index,
        id=id_ if id_ is not None else str(index),
        type=type_,
        message=f"line {index}: {_one_line(problem)}",
    )


def show_bytes(n: int) -> str:
    """`8388608` -> `8,388,608 bytes (8 MiB)`: exact, and readable at a glance."""
    text = f"{n:,} bytes"
    return f"{text} ({n // MIB} MiB)" if n >= MIB and n % MIB == 0 else text


def json_syntax_problem(exc: json.JSONDecodeError, text: str) -> str:
    """Say what is wrong and where; a raw control character (a NUL byte, say) is named,
    since it is invisible in most editors."""
    found = text[exc.pos] if exc.pos < len(text) else ""
    if exc.msg.startswith("Invalid control character"):
        return (
            f"invalid JSON: unescaped control character U+{ord(found):04X} in a string "
            f"at column {exc.colno}"
        )
    # json's messages like "Unterminated string starting at" expect a position after them.
    problem = f"invalid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}"
    if found and ord(found) < 0x20 and found not in " \t\r\n":
        problem += f" (found control character U+{ord(found):04X})"
    return problem


def _quote_list(names: Sequence[str]) -> str:
    """`['a', 'b', 'c']` -> `'a', 'b' and 'c'`."""
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def error_rank(error: ValidationError) -> int:
    """Order errors so the message points at the root cause.

    An unknown field is usually a typo ('promt') that also trips the prompt/messages
    rule, so it wins; field-level problems come next; the whole-line rules last.
    """
    at_root = not error.path
    if at_root and error.validator == "additionalProperties":
        return 0
    if not at_root:
        return 1
    if error.validator == "oneOf":
        return 2
    if error.validator == "not":
        return 3
    return 4


def describe(error: ValidationError) -> str:
    """Turn one jsonschema error into plain words naming the field and the problem."""
    kind = error.validator
    where = field_path(list(error.absolute_path))  # an `anyOf` branch's error: from the line
    field_ = f"field '{where}'"
    inst = error.instance
    value = error.validator_value

    if kind == "additionalProperties" and isinstance(inst, dict):
        known = error.schema.get("properties", {})
        unknown = sorted(k for k in inst if k not in known)
        noun = "field" if len(unknown) == 1 else "fields"
        suffix = f" in '{where}'" if where else ""
        hint = did_you_mean(unknown, known, alone=True)
        return f"unknown {noun} {_quote_list(unknown)}{suffix}" + (f" ({hint})" if hint else "")
    if kind == "type":
        wanted = " or ".join(value) if isinstance(value, list) else str(value)
        return f"{field_} must be {wanted}, got {show(inst)}"
    if kind == "required":
        missing = [name for name in value if isinstance(inst, dict) and name not in inst]
        return f"{field_} is missing required field {_quote_list(missing or list(value))}"
    if kind == "oneOf" and not where:
        if isinstance(inst, dict) and "prompt" in inst and "messages" in inst:
            return "exactly one of 'prompt' or 'messages' is required, got both"
        return "exactly one of 'prompt' or 'messages' is required"
    if kind == "not" and not where and isinstance(inst, dict):
        given = [k for k in ("json_schema", "regex", "choices", "grammar") if k in inst]
        return (
            "at most one of 'json_schema', 'regex', 'choices' or 'grammar' may be given, "
            f"got {_quote_list(given)}"
        )
    if kind in ("anyOf", "oneOf") and where and error.context:
        return _alternatives(error, field_)
    if kind == "enum":
        return f"{field_} must be one of {', '.join(show(v) for v in value)}, got {show(inst)}"
    if kind == "const":
        return f"{field_} must be {show(value)}, got {show(inst)}"
    if kind == "minimum":
        return f"{field_} must be >= {value}, got {show(inst)}"
    if kind == "maximum":
        return f"{field_} must be <= {value}, got {show(inst)}"
    if kind == "exclusiveMinimum":
        return f"{field_} must be > {value}, got {show(inst)}"
    if kind == "exclusiveMaximum":
        return f"{field_} must be < {value}, got {show(inst)}"
    if kind == "pattern" and "propertyNames" in error.schema_path:
        return f"{field_} key {show(inst)} is not a token id (a string of at most 18 digits)"
    if kind in ("minLength", "pattern") and isinstance(inst, str) and not inst.strip():
        return f"{field_} must not be empty"
    if kind == "minLength":
        return f"{field_} must be at least {value} characters long"
    if kind == "maxLength":
        return f"{field_} must be at most {value} characters long"
    if kind == "minItems":
        if value == 1:
            return f"{field_} must not be empty"
        return f"{field_} must have at least {value} items, got {len(inst)}"
    if kind == "maxItems":
        return f"{field_} must have at most {value} items, got {len(inst)}"
    return f"{field_}: {error.message}" if where else error.message


def _alternatives(error: ValidationError, field_: str) -> str:
    """A field that may take one of several shapes: what is wrong with the value in the
    shape of its own type (`"sometimes"` against the strings allowed, not against the
    object form), or which types it may have."""
    context = list(error.context or [])
    # Each error's branch is the first step of its schema path; a branch whose type the
    # value does not have says nothing more about it.
    mismatched = [e for e in context if e.validator == "type" and not e.relative_path]
    foreign = {e.relative_schema_path[0] for e in mismatched}
    fitting = [e for e in context if e.relative_schema_path[0] not in foreign]
    if fitting:
        return describe(max(fitting, key=lambda e: len(e.relative_path)))
    types = [t for e in mismatched for t in (
        e.validator_value if isinstance(e.validator_value, list) else [e.validator_value])]
    return f"{field_} must be {' or '.join(dict.fromkeys(types))}, got {show(error.instance)}"
