"""JSONL in and out: input lines become `Job`s or `LineError`s; results become lines.

A bad input line never raises out of `read_jobs`: it becomes a `LineError` that the
caller writes as an error result, so every input line ends as exactly one result line.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.validators import validator_for

ConstraintKind = Literal["json_schema", "regex", "choices", "lark"]


@dataclass(frozen=True)
class Constraint:
    """What a built-in controller enforces. `value` is a schema dict, a regex or a list."""

    kind: ConstraintKind
    value: Any


@dataclass(frozen=True)
class JobDefaults:
    """CLI-level defaults; a line's own fields override them."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None


@dataclass(frozen=True)
class Job:
    """One validated input line, ready for the engine."""

    index: int  # 1-based input line number
    id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LineError:
    """An input line that cannot run; it becomes a result with finish_reason "error"."""

    index: int
    id: str
    type: str
    message: str


class UsageError(Exception):
    """A problem with how the CLI was invoked (e.g. unreadable input); the CLI prints it
    as one line and exits with a usage status instead of showing a traceback."""


# --------------------------------------------------------------------------- schemas

_SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"


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
def _validator(name: str) -> Draft202012Validator:
    """Build each validator once: construction walks the schema, validation is per line."""
    return Draft202012Validator(load_schema(name))


# ------------------------------------------------------------------- error messages

_JSON_TYPE_NAMES: dict[type, str] = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    type(None): "null",
}


def _json_type(value: Any) -> str:
    """Name a value's type the way the user wrote it (JSON), not the Python way."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _show(value: Any, limit: int = 60) -> str:
    """Render an offending value compactly, as JSON, truncated so messages stay one line."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_path(path: Sequence[str | int]) -> str:
    """`['messages', 0, 'role']` -> `messages[0].role`: how a user would name the spot."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _quote_list(names: Sequence[str]) -> str:
    """`['a', 'b', 'c']` -> `'a', 'b' and 'c'`."""
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _error_rank(error: ValidationError) -> int:
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


def _describe(error: ValidationError) -> str:
    """Turn one jsonschema error into plain words naming the field and the problem."""
    kind = error.validator
    where = _field_path(list(error.path))
    field_ = f"field '{where}'"
    inst = error.instance
    value = error.validator_value

    if kind == "additionalProperties" and isinstance(inst, dict):
        known = error.schema.get("properties", {})
        unknown = sorted(k for k in inst if k not in known)
        noun = "field" if len(unknown) == 1 else "fields"
        suffix = f" in '{where}'" if where else ""
        return f"unknown {noun} {_quote_list(unknown)}{suffix}"
    if kind == "type":
        wanted = " or ".join(value) if isinstance(value, list) else str(value)
        return f"{field_} must be {wanted}, got {_show(inst)}"
    if kind == "required":
        missing = [name for name in value if isinstance(inst, dict) and name not in inst]
        return f"{field_} is missing required field {_quote_list(missing or list(value))}"
    if kind == "oneOf" and not where:
        if isinstance(inst, dict) and "prompt" in inst and "messages" in inst:
            return "exactly one of 'prompt' or 'messages' is required, got both"
        return "exactly one of 'prompt' or 'messages' is required"
    if kind == "not" and not where and isinstance(inst, dict):
        given = [k for k in ("json_schema", "regex", "choices") if k in inst]
        return (
            "at most one of 'json_schema', 'regex' or 'choices' may be given, "
            f"got {_quote_list(given)}"
        )
    if kind == "minimum":
        return f"{field_} must be >= {value}, got {_show(inst)}"
    if kind == "maximum":
        return f"{field_} must be <= {value}, got {_show(inst)}"
    if kind == "exclusiveMinimum":
        return f"{field_} must be > {value}, got {_show(inst)}"
    if kind == "exclusiveMaximum":
        return f"{field_} must be < {value}, got {_show(inst)}"
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


# ------------------------------------------------------------------------ reading


def _line_error(index: int, id_: str | None, type_: str, problem: str) -> LineError:
    """Every message starts with `line N: ` so it reads well on its own in a log."""
    return LineError(
        index=index,
        id=id_ if id_ is not None else str(index),
        type=type_,
        message=f"line {index}: {problem}",
    )


def _reject_constant(name: str) -> Any:
    """NaN/Infinity are not JSON, and NaN slips through every numeric range check."""
    raise ValueError(f"{name} is not valid JSON")


def _check_json_schema(schema: dict[str, Any]) -> str | None:
    """Return a description of why `schema` is not a usable JSON Schema, or None.

    An unknown `$schema` only warns in jsonschema today (and will raise later), so it
    is turned into an error here rather than leaking a DeprecationWarning per line.
    """
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        return f"'$schema' must be a string, got {_show(dialect)}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls = validator_for(schema)  # no $schema -> latest draft (2020-12)
    if any(issubclass(w.category, DeprecationWarning) for w in caught):
        return f"unknown '$schema' {_show(dialect)}"
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        where = _field_path(list(exc.path))
        return f"at '{where}': {exc.message}" if where else exc.message
    return None


def _parse_line(raw: str | bytes, index: int, defaults: JobDefaults) -> Job | LineError | None:
    """Turn one physical line into a Job, a LineError, or None for a blank line."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = f"invalid UTF-8 at byte {exc.start + 1} ({exc.reason})"
            return _line_error(index, None, "invalid_utf8", problem)
    else:
        text = raw
    if index == 1:
        text = text.removeprefix("\ufeff")  # editors on Windows like to add a BOM
    if not text.strip():
        return None

    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        problem = f"invalid JSON: {exc.msg} at column {exc.colno}"
        return _line_error(index, None, "invalid_json", problem)
    except ValueError as exc:  # from _reject_constant
        return _line_error(index, None, "invalid_json", f"invalid JSON: {exc}")
    except RecursionError:
        return _line_error(index, None, "invalid_json", "invalid JSON: nested too deeply")

    if not isinstance(obj, dict):
        problem = f"expected a JSON object, got {_json_type(obj)}"
        return _line_error(index, None, "invalid_line", problem)

    raw_id = obj.get("id")
    id_ = raw_id if isinstance(raw_id, str) else None

    try:
        errors = sorted(_validator("input-line").iter_errors(obj), key=_error_rank)
    except RecursionError:
        return _line_error(index, id_, "invalid_line", "line is nested too deeply")
    if errors:
        first = errors[0]
        is_prompt = list(first.path) == ["prompt"] and first.validator in (
            "minLength",
            "pattern",
        )
        type_ = "empty_prompt" if is_prompt else "invalid_line"
        return _line_error(index, id_, type_, _describe(first))

    if "json_schema" in obj:
        try:
            problem_ = _check_json_schema(obj["json_schema"])
        except RecursionError:
            problem_ = "nested too deeply"
        if problem_ is not None:
            problem = f"field 'json_schema' is not a valid JSON Schema: {problem_}"
            return _line_error(index, id_, "invalid_schema", problem)
        constraint: Constraint | None = Constraint("json_schema", obj["json_schema"])
    elif "regex" in obj:
        try:
            re.compile(obj["regex"])
        except (re.error, RecursionError, OverflowError) as exc:
            problem = f"field 'regex' is not a valid regular expression: {exc}"
            return _line_error(index, id_, "invalid_regex", problem)
        constraint = Constraint("regex", obj["regex"])
    elif "choices" in obj:
        constraint = Constraint("choices", list(obj["choices"]))
    else:
        constraint = defaults.constraint

    extra: dict[str, Any] = {}
    if "controller_arg" in obj:
        extra["controller_arg"] = obj["controller_arg"]
    messages = obj.get("messages")

    # JSON Schema counts 5.0 as an integer, so convert instead of trusting the type.
    return Job(
        index=index,
        id=id_ if id_ is not None else str(index),
        prompt=obj.get("prompt"),
        messages=[dict(m) for m in messages] if messages is not None else None,
        max_tokens=int(obj.get("max_tokens", defaults.max_tokens)),
        temperature=float(obj.get("temperature", defaults.temperature)),
        top_p=float(obj.get("top_p", defaults.top_p)),
        seed=int(obj.get("seed", defaults.seed)),
        stop=tuple(obj["stop"]) if "stop" in obj else tuple(defaults.stop),
        constraint=constraint,
        extra=extra,
    )


def read_jobs(lines: Iterable[str | bytes], defaults: JobDefaults) -> Iterator[Job | LineError]:
    """Yield one Job or LineError per non-blank line, reading lazily.

    Lazy so that a stream like stdin can be processed while it is still being written;
    `index` counts every physical line (blank ones too) so results point back at the
    exact line in the user's file even when ids are missing or repeated.
    """
    for index, raw in enumerate(lines, start=1):
        item = _parse_line(raw, index, defaults)
        if item is not None:
            yield item


# ------------------------------------------------------------------------ writing

ZERO_STATS: dict[str, int | float] = {
    "prompt_tokens": 0,
    "output_tokens": 0,
    "forward_passes": 0,
    "ff_tokens": 0,
    "ttft_ms": 0.0,
    "total_ms": 0.0,
    "forward_ms": 0.0,
    "mask_ms": 0.0,
    "controller_ms": 0.0,
    "sample_ms": 0.0,
}


def error_result(err: LineError) -> dict[str, Any]:
    """The result line for an input line that could not run, so output stays 1:1 with
    input and consumers can join on `index` without special cases."""
    return {
        "id": err.id,
        "index": err.index,
        "text": "",
        "finish_reason": "error",
        "error": {"type": err.type, "message": err.message},
        "stats": dict(ZERO_STATS),
    }


def _finite(value: Any) -> Any:
    """Replace NaN/Infinity (not JSON) with null so one odd float cannot break a line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# U+0085, U+2028 and U+2029 are legal raw inside JSON strings, but str.splitlines() and
# some JSONL readers treat them as line breaks; escaping them keeps one result per line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(result: Mapping[str, Any]) -> str:
    try:
        text = json.dumps(result, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(
            _finite(result), ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
    return text.translate(_LINE_BREAKS)


class ResultWriter:
    """Writes result dicts as JSONL, one compact line each, flushed immediately.

    Flushing per line lets a consumer tail the output while a long batch runs, and means
    a crash loses at most the line in flight. A BrokenPipeError (consumer went away, e.g.
    `| head`) propagates unchanged so the CLI can exit quietly.
    """

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.written = 0
        self.errors = 0

    def write(self, result: Mapping[str, Any]) -> None:
        line = _dumps(result) + "\n"
        self.stream.write(line)
        self.stream.flush()
        self.written += 1
        if result.get("finish_reason") == "error":
            self.errors += 1


def open_input(path: str) -> BinaryIO:
    """Open the JSONL input in binary so bad UTF-8 becomes a per-line error, not a crash
    of the whole run; "-" means stdin."""
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")  # the caller owns and closes it
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"cannot read input file '{path}': {reason}") from None
