"""The tool's own line formats: the JSON Schemas in `schemas/` and one cached validator
for each, shared by everything that checks a line against them (input lines, result
lines, run summaries, OpenAI batch output).

`schema_check` answers only "valid or not", with jsonschema-rs where it is installed:
`aici-batch report` checks every result line and `run` every input line, and
jsonschema-rs compiles a schema into a checker 30-40x faster than jsonschema's (~10 us
against ~390 us an input line of the examples). Messages (which field, what is wrong) come
from jsonschema's `schema_validator`, asked only about a value found invalid.

Torch-free: the CLI and `report` import it at startup.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"  # the checkout's schemas/


def _schema_filename(name: str) -> str:
    """Accept both "input-line" and "input-line.schema.json" so callers need not care."""
    return name if name.endswith(".json") else f"{name}.schema.json"


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    """Load a schema by name ("input-line", "result-line", "stats").

    The canonical files live in `schemas/` at the repo root so they are easy to find
    and publish; an installed package has no repo root, so fall back to the copies
    shipped as package data under `aici_cli/schemas`. The result is cached and shared:
    do not mutate it.
    """
    filename = _schema_filename(name)
    if _SCHEMA_DIR.is_dir():
        text = (_SCHEMA_DIR / filename).read_text(encoding="utf-8")
    else:
        resource = importlib.resources.files("aici_cli").joinpath("schemas", filename)
        text = resource.read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def schema_validator(name: str) -> Draft202012Validator:
    """The validator for schema `name`, built once: construction walks the schema,
    checking a line does not."""
    return Draft202012Validator(load_schema(name))


# A `pattern` escape whose class differs between Python's `re` and jsonschema-rs's
# ECMA-style regexes: Python's `\s` is `str.isspace` (U+001C..U+001F and U+0085
# included), ECMA's is not, so `\S` matches "\x1c" in Rust and not in Python.
_UNICODE_CLASS = re.compile(r"\\[sSdDwWbB]")
# Python's `\s`, spelled out as a class both engines read alike.
_PY_SPACE = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())
_NOT_DATA = ("const", "enum", "default", "examples")  # values, not schemas


def _as_rust(schema: Any) -> Any:
    r"""`schema` with each `pattern`'s `\s` and `\S` spelled as Python reads them, so
    jsonschema-rs accepts what jsonschema accepts; ValueError where a pattern keeps a
    class the two read differently (`\d`, `\w`, a `\s` inside brackets)."""
    if isinstance(schema, list):
        return [_as_rust(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            if "[" not in value and "\\\\" not in value:  # no class, no escaped `\`
                value = value.replace("\\S", f"[^{_PY_SPACE}]").replace("\\s", f"[{_PY_SPACE}]")
            if _UNICODE_CLASS.search(value):
                raise ValueError(f"pattern {value!r} reads differently in Rust")
        elif key not in _NOT_DATA:
            value = _as_rust(value)
        out[key] = value
    return out


@functools.cache
def _fast_check(name: str) -> Callable[[Any], bool] | None:
    """jsonschema-rs's `is_valid` for schema `name`, compiled once; None without it (a
    platform it has no wheel for) or where its regexes could accept what jsonschema's
    refuse (`_as_rust`): jsonschema alone then answers."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    try:
        schema = _as_rust(load_schema(name))
    except ValueError:
        return None
    check: Callable[[Any], bool] = jsonschema_rs.validator_for(schema).is_valid
    return check


def schema_check(name: str) -> Callable[[Any], bool]:
    """Whether a value validates against schema `name`, exactly as jsonschema decides:
    a function to call once per line (what it needs is looked up here, once).

    jsonschema-rs answers first; only its "valid" is taken as it stands. A "no", or a
    value it cannot read (an int past 64 bits, a NaN), goes to jsonschema, the reference:
    the two differ at the edges (Python's `$` in a `pattern` also matches before a final
    newline, Rust's does not), and an invalid value is rare and about to be explained by
    jsonschema anyway."""
    fast = _fast_check(name)
    reference = schema_validator(name).is_valid

    def check(value: Any) -> bool:
        if fast is not None:
            try:
                if fast(value):
                    return True
            except (ValueError, TypeError, OverflowError):
                pass
        return bool(reference(value))

    return check


def schema_valid(name: str, value: Any) -> bool:
    """`schema_check(name)(value)`, for a single value."""
    return schema_check(name)(value)
