"""JSONL in and out: input lines become `Job`s or `LineError`s; results become lines.

A bad input line never raises out of `read_jobs`: it becomes a `LineError` that the
caller writes as an error result, so every input line ends as exactly one result line.
"""

from __future__ import annotations

import errno
import functools
import importlib.resources
import json
import math
import os
import re
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.validators import validator_for
from jsonschema_specifications import REGISTRY as META_SCHEMAS
from referencing import Registry, Resource, Specification
from referencing.exceptions import NoSuchAnchor, NoSuchResource, PointerToNowhere, Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

from aici_cli.config import MIB, JobDefaults
from aici_cli.control.constraint import Constraint
from aici_cli.errors import UsageError


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
    n: int = 1  # samples of this prompt; they share its prefill


@dataclass(frozen=True)
class LineError:
    """An input line that cannot run; it becomes a result with finish_reason "error"."""

    index: int
    id: str
    type: str
    message: str


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


# Longest text of one problem in a message: values are quoted in messages, and a value
# can be megabytes long; a message must stay a readable single line.
_MAX_PROBLEM_CHARS = 500

# Longest integer literal accepted (Python's own default limit for int(str)): parsing a
# longer one costs quadratic time, and no field takes one.
_MAX_INT_DIGITS = 4300

# A lone surrogate can enter only as a `\ud800`-style escape (UTF-8 input cannot encode
# one) or, for str input, as the character itself; a valid pair matches too, so a match
# only means the parsed value must be searched.
_SURROGATE_HINT = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")

_CONSTRAINT_FIELDS = ("json_schema", "regex", "choices")

# A subschema and the resolver for the references in it (referencing does not export the
# Resolver type).
SchemaNode = tuple[Any, Resource[Any]]

# A JSON string token, escapes included: written so that a long string is one fast run
# of the character class, not one alternation per character.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _one_line(problem: str) -> str:
    """Collapse line breaks and cut to `_MAX_PROBLEM_CHARS`: a message is one log line."""
    text = re.sub(r"\s*[\r\n\x0b\x0c\x1c-\x1e\x85\u2028\u2029]+\s*", " ", problem)
    if len(text) <= _MAX_PROBLEM_CHARS:
        return text
    return text[: _MAX_PROBLEM_CHARS - 3] + "..."


def _line_error(index: int, id_: str | None, type_: str, problem: str) -> LineError:
    """Every message starts with `line N: ` so it reads well on its own in a log."""
    return LineError(
        index=index,
        id=id_ if id_ is not None else str(index),
        type=type_,
        message=f"line {index}: {_one_line(problem)}",
    )


def _limit(n: int) -> str:
    """`8388608` -> `8,388,608 bytes (8 MiB)`: exact, and readable at a glance."""
    text = f"{n:,} bytes"
    return f"{text} ({n // MIB} MiB)" if n >= MIB and n % MIB == 0 else text


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


# ------------------------------------------------------------------ line checks


def _ending_length(raw: str | bytes) -> int:
    """Length of the line ending (LF or CRLF) that `raw` ends with, if any."""
    tail = raw[-2:]
    ending = tail.decode("latin-1") if isinstance(tail, bytes) else tail
    return 2 if ending == "\r\n" else 1 if ending.endswith("\n") else 0


def _size_error(raw: str | bytes, index: int, limit: int) -> LineError | None:
    """Refuse a line over `limit` UTF-8 bytes (line ending excluded) before decoding or
    parsing it, so an oversized line costs no more than having been read."""
    end = len(raw) - _ending_length(raw)
    if isinstance(raw, str) and end > limit // 4:
        # A character is 1 to 4 bytes: measure exactly only where the limit is in reach.
        end = len(raw[:end].encode("utf-8", "surrogatepass"))
    if end <= limit:
        return None
    problem = f"line is {end:,} bytes, over the limit of {_limit(limit)}"
    return _line_error(index, None, "line_too_large", problem)


def _decode(raw: str | bytes, index: int) -> str | LineError:
    """The line as text; bad UTF-8 is this line's error, not the run's."""
    if not isinstance(raw, bytes):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"invalid UTF-8 at byte {exc.start + 1} ({exc.reason})"
        return _line_error(index, None, "invalid_utf8", problem)


def _json_syntax_problem(exc: json.JSONDecodeError, text: str) -> str:
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


def _load(text: str, index: int, max_depth: int) -> Any:
    """Parse one line's JSON; a LineError (never an exception) when it cannot be."""
    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
        )
    except json.JSONDecodeError as exc:
        return _line_error(index, None, "invalid_json", _json_syntax_problem(exc, text))
    except ValueError as exc:  # from the parse_* hooks
        return _line_error(index, None, "invalid_json", f"invalid JSON: {exc}")
    except RecursionError:
        # json's C parser recurses per level and stops near Python's stack limit (about
        # 1000 levels), far beyond `max_depth`.
        problem = f"JSON nested too deeply to parse, over the limit of {max_depth} levels"
        return _line_error(index, None, "too_deep", problem)


def _text_depth(text: str) -> int:
    """Nesting depth of valid JSON `text` (0 for a scalar, 1 for `[]` or `{}`).

    Worked out on the text, not on the parsed value: a walk in Python over a line of a
    million small arrays takes seconds, these few whole-text steps take milliseconds.
    Brackets inside strings do not count, so strings go first; what is left is ASCII.
    """
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


def _depth_problem(obj: Any, text: str, max_depth: int) -> str | None:
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


def _find_surrogate(value: Any, path: tuple[str | int, ...]) -> tuple[str, str] | None:
    """(where, character) of the first lone surrogate in `value`, keys included.

    Recursive, which is safe: the depth was checked first.
    """
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        where = f"field '{_field_path(path)}'" if path else "the line"
        return (where, found.group()) if found else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _SURROGATE.search(key)
            if found:
                owner = f"in '{_field_path(path)}'" if path else "of the line"
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


def _unicode_problem(obj: Any, text: str) -> str | None:
    """A lone surrogate (`"\\ud800"` with no partner) is valid JSON syntax but not
    Unicode: the tokenizer, the grammar compiler and UTF-8 output all choke on it."""
    if not _SURROGATE_HINT.search(text):
        return None
    hit = _find_surrogate(obj, ())
    if hit is None:
        return None
    where, char = hit
    return f"{where} contains a lone surrogate \\u{ord(char):04x}, which is not valid Unicode"


def _readable_id(obj: dict[str, Any]) -> str | None:
    """The line's own id where results can echo it: a string with no lone surrogate."""
    raw_id = obj.get("id")
    if isinstance(raw_id, str) and not _SURROGATE.search(raw_id):
        return raw_id
    return None


def _json_bytes(value: Any) -> int:
    """Size of `value` written as compact JSON in UTF-8: the same whatever the spacing
    of the input line."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def _constraint_size_problem(obj: dict[str, Any], limit: int) -> tuple[str, str] | None:
    """(type, problem) when the line's constraint is over `limit` bytes, checked before
    the schema checker or the grammar compiler spends time on it."""
    for name in _CONSTRAINT_FIELDS:
        if name not in obj:
            continue
        size = _json_bytes(obj[name])
        if size > limit:
            type_ = "schema_too_large" if name == "json_schema" else "constraint_too_large"
            problem = f"field '{name}' is {size:,} bytes as JSON, over the limit of {_limit(limit)}"
            return type_, problem
    return None


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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # from `pattern`s, as for `regex`
            cls.check_schema(schema)
    except SchemaError as exc:
        where = _field_path(list(exc.path))
        return f"at '{where}': {exc.message}" if where else exc.message
    except OverflowError as exc:
        # jsonschema compiles each `pattern` with `re` and expects only re.error; a
        # repetition like `a{4294967295}` raises OverflowError instead.
        return f"a 'pattern' in it is not a valid regular expression: {exc}"
    return None


_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords that apply a subschema to the value itself rather than to a part of it: a
# path through only these and references never gets closer to the end of the value.
_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_LIST = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas", "dependencies")
# Drafts in which `$ref` makes every keyword beside it ignored.
_REF_ALONE_DRAFTS = {"draft-03", "draft-04", "draft-06", "draft-07"}
_LOOKUP_ERRORS = (Unresolvable, LookupError, TypeError, ValueError)


def _ref_problem(ref: str, exc: Exception) -> str:
    """Why `ref` does not resolve, without the resource's text the exception carries."""
    if isinstance(exc, NoSuchAnchor):
        reason = "the schema has no such anchor"
    elif isinstance(exc, NoSuchResource) or not ref.startswith("#"):
        reason = "it is not part of this schema, and schemas are never fetched"
    elif isinstance(exc, (PointerToNowhere, LookupError, TypeError, ValueError)):
        # referencing raises TypeError for a pointer through a boolean schema, and
        # ValueError for a non-numeric array index.
        reason = "the schema has no such location"
    else:
        reason = type(exc).__name__
    return f"'{ref}' cannot be resolved: {reason}"


def _schema_nodes(schema: dict[str, Any]) -> tuple[Specification[Any], list[SchemaNode]]:
    """Every subschema of `schema`, each with the resolver for references inside it.

    References resolve the way jsonschema resolves them when it validates an output,
    but with no retrieval: jsonschema would otherwise fetch a remote `$ref` over the
    network (which can hang). Only meta-schemas are known besides the schema itself.
    """
    dialect = schema.get("$schema", "")
    spec = specification_with(dialect, default=DRAFT202012) if dialect else DRAFT202012
    root: Resource[Any] = spec.create_resource(schema)
    nodes = [(META_SCHEMAS.combine(Registry()).resolver_with_root(root), root)]
    for resolver, resource in nodes:  # grows while it is walked
        nodes.extend((resolver.in_subresource(sub), sub) for sub in resource.subresources())
    return spec, nodes


def _unresolvable_ref(nodes: list[SchemaNode]) -> str | None:
    """Describe the first reference that does not resolve, or None."""
    for resolver, resource in nodes:
        contents = resource.contents
        if not isinstance(contents, dict):
            continue
        for keyword in _REF_KEYWORDS:
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except _LOOKUP_ERRORS as exc:
                return f"{keyword} {_ref_problem(ref, exc)}"
    return None


def _in_place(
    contents: dict[str, Any], resolver: Any, spec: Specification[Any]
) -> list[tuple[dict[str, Any], Any, str]]:
    """The object subschemas that `contents` applies to the value itself, each with the
    resolver to use inside it and the keyword that leads there."""
    out: list[tuple[dict[str, Any], Any, str]] = []
    for keyword in _REF_KEYWORDS:
        ref = contents.get(keyword)
        if isinstance(ref, str):
            try:
                resolved = resolver.lookup(ref)
            except _LOOKUP_ERRORS:
                continue  # reported by _unresolvable_ref
            if isinstance(resolved.contents, dict):
                out.append((resolved.contents, resolved.resolver, f"{keyword} '{ref}'"))
    if spec.name in _REF_ALONE_DRAFTS and "$ref" in contents:
        return out
    children: list[tuple[Any, str]] = [(contents.get(k), k) for k in _IN_PLACE_ONE]
    for keyword in _IN_PLACE_LIST:
        members = contents.get(keyword)
        if isinstance(members, list):
            children += [(member, f"{keyword}[{i}]") for i, member in enumerate(members)]
    for keyword in _IN_PLACE_MAP:
        members = contents.get(keyword)
        if isinstance(members, dict):
            children += [(member, f"{keyword}.{name}") for name, member in members.items()]
    for child, label in children:
        if isinstance(child, dict):
            inner = resolver.in_subresource(spec.create_resource(child))
            out.append((child, inner, label))
    return out


def _reference_loop(
    spec: Specification[Any], nodes: list[SchemaNode], limit: int
) -> tuple[str, str] | None:
    """(type, problem) when references make a schema apply to the same value forever
    (`{"$ref": "#"}`), or through a chain longer than `limit`.

    JSON Schema leaves such a loop undefined. jsonschema follows it by recursion when
    it checks an output, so it ends in RecursionError however small the output, and so
    does a long enough chain; llguidance may accept either. A path that goes into a
    property or an item is fine: the output is finite. Depth-first over the in-place
    edges, without recursion.
    """
    on_path, done = 1, 2
    state: dict[int, int] = {}
    longest: dict[int, int] = {}  # schemas in the longest in-place path from a schema
    for resolver, resource in nodes:
        start = resource.contents
        if not isinstance(start, dict) or id(start) in state:
            continue
        state[id(start)] = on_path
        frames = [(start, _in_place(start, resolver, spec), 0)]
        while frames:
            node, edges, next_edge = frames[-1]
            if next_edge < len(edges):
                frames[-1] = (node, edges, next_edge + 1)
                child, child_resolver, label = edges[next_edge]
                seen = state.get(id(child))
                if seen == on_path:
                    problem = (f"is not a valid JSON Schema: {label} loops back to a schema "
                               "it is part of without going into the value (endless recursion)")
                    return "invalid_schema", problem
                if seen is None:
                    state[id(child)] = on_path
                    frames.append((child, _in_place(child, child_resolver, spec), 0))
                continue
            frames.pop()
            state[id(node)] = done
            longest[id(node)] = 1 + max((longest[id(child)] for child, _, _ in edges), default=0)
    chain = max(longest.values(), default=0)
    if chain <= limit:
        return None
    problem = (f"chains {chain:,} schemas through references and allOf/anyOf/oneOf/not/if "
               f"without going into the value, over the limit of {limit}")
    return "too_deep", problem


def _schema_problem(schema: dict[str, Any], max_depth: int) -> tuple[str, str] | None:
    """(type, problem) for a `json_schema` that cannot be used as it is, or None."""
    try:
        invalid = _check_json_schema(schema)
        if invalid is not None:
            return "invalid_schema", f"is not a valid JSON Schema: {invalid}"
        spec, nodes = _schema_nodes(schema)
        unresolvable = _unresolvable_ref(nodes)
        if unresolvable is not None:
            return "invalid_schema", f"is not a valid JSON Schema: {unresolvable}"
        return _reference_loop(spec, nodes, max_depth)
    except RecursionError:
        return "too_deep", "is nested too deeply to check"


def _validation_error(obj: dict[str, Any], index: int, id_: str | None) -> LineError | None:
    """Check the line against schemas/input-line.schema.json, reporting the root cause."""
    try:
        errors = sorted(_validator("input-line").iter_errors(obj), key=_error_rank)
    except RecursionError:
        return _line_error(index, id_, "too_deep", "line is nested too deeply to validate")
    if not errors:
        return None
    first = errors[0]
    is_prompt = list(first.path) == ["prompt"] and first.validator in ("minLength", "pattern")
    type_ = "empty_prompt" if is_prompt else "invalid_line"
    return _line_error(index, id_, type_, _describe(first))


def _constraint(
    obj: dict[str, Any], index: int, id_: str | None, defaults: JobDefaults
) -> Constraint | LineError | None:
    """The line's own constraint, checked as far as can be without a tokenizer, or the
    default one."""
    if "json_schema" in obj:
        unusable = _schema_problem(obj["json_schema"], defaults.max_depth)
        if unusable is not None:
            type_, problem = unusable
            return _line_error(index, id_, type_, f"field 'json_schema' {problem}")
        return Constraint("json_schema", obj["json_schema"])
    if "regex" in obj:
        try:
            with warnings.catch_warnings():
                # re warns about constructs like `[[` whose meaning may change: stderr is
                # no place for a note about one line.
                warnings.simplefilter("ignore", FutureWarning)
                re.compile(obj["regex"])
        except (re.error, RecursionError, OverflowError) as exc:
            problem = f"field 'regex' is not a valid regular expression: {exc}"
            return _line_error(index, id_, "invalid_regex", problem)
        return Constraint("regex", obj["regex"])
    if "choices" in obj:
        return Constraint("choice", list(obj["choices"]))
    return defaults.constraint


# Maps a parsed line of another format (e.g. an OpenAI batch request) onto this one's
# fields, given the line number; raises ValueError with a message naming the problem.
Translate = Callable[[dict[str, Any], int], dict[str, Any]]


def _parse_line(raw: str | bytes, index: int, defaults: JobDefaults,
                translate: Translate | None = None) -> Job | LineError | None:
    """Turn one physical line into a Job, a LineError, or None for a blank line.

    Checks run cheapest first, and each one bounds what the next may cost: size before
    decoding, depth before any recursive walk, constraint size before schema checking.
    """
    too_large = _size_error(raw, index, defaults.max_line_bytes)
    if too_large is not None:
        return too_large
    text = _decode(raw, index)
    if isinstance(text, LineError):
        return text
    if index == 1:
        text = text.removeprefix("\ufeff")  # editors on Windows like to add a BOM
    if not text.strip():
        return None
    # json counts columns from the last newline: with the line's own ending still there,
    # an error at the end of the line would be reported at column 1 of a line 2.
    text = text[: len(text) - _ending_length(text)]

    obj = _load(text, index, defaults.max_depth)
    if isinstance(obj, LineError):
        return obj
    too_deep = _depth_problem(obj, text, defaults.max_depth)
    if too_deep is not None:
        return _line_error(index, None, "too_deep", too_deep)
    bad_unicode = _unicode_problem(obj, text)
    if bad_unicode is not None:
        id_ = _readable_id(obj) if isinstance(obj, dict) else None
        return _line_error(index, id_, "invalid_unicode", bad_unicode)
    if not isinstance(obj, dict):
        problem = f"expected a JSON object, got {_json_type(obj)}"
        return _line_error(index, None, "invalid_line", problem)
    if translate is not None:
        try:
            obj = translate(obj, index)
        except ValueError as e:
            custom_id = obj.get("custom_id")
            id_ = custom_id if isinstance(custom_id, str) else None
            return _line_error(index, id_, "invalid_request", str(e))

    id_ = _readable_id(obj)
    # Before validation: validating a million `choices` alone takes seconds.
    oversized = _constraint_size_problem(obj, defaults.max_constraint_bytes)
    if oversized is not None:
        return _line_error(index, id_, *oversized)
    invalid = _validation_error(obj, index, id_)
    if invalid is not None:
        return invalid
    constraint = _constraint(obj, index, id_, defaults)
    if isinstance(constraint, LineError):
        return constraint

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
        n=int(obj.get("n", defaults.n)),
    )


def _parse_safely(raw: str | bytes, index: int, defaults: JobDefaults,
                  translate: Translate | None) -> Job | LineError | None:
    """`_parse_line`, with any failure it did not foresee confined to its own line: one
    odd line must not end a run of thousands."""
    try:
        return _parse_line(raw, index, defaults, translate)
    except Exception as exc:  # a bug in the checks, reported like the engine reports its own
        problem = f"line could not be read: {type(exc).__name__}: {exc}"
        return _line_error(index, None, "internal_error", problem)


def read_jobs(lines: Iterable[str | bytes], defaults: JobDefaults,
              translate: Translate | None = None) -> Iterator[Job | LineError]:
    """Yield one Job or LineError per non-blank line, reading lazily.

    Lazy so that a stream like stdin can be processed while it is still being written;
    `index` counts every physical line (blank ones too) so results point back at the
    exact line in the user's file even when ids are missing or repeated. `translate`
    maps each parsed object from another line format first (see `openai_batch`).
    """
    for index, raw in enumerate(lines, start=1):
        item = _parse_safely(raw, index, defaults, translate)
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
    """Writes result dicts as JSONL, one compact line each, in the OS before `write`
    returns.

    Where the stream has a file descriptor, each line goes to it in one `os.write` of the
    whole line (repeated only after a short write), past Python's buffers: a process
    killed at any moment leaves complete lines and at most one torn last line, which
    `--resume` repairs, and a consumer can tail the output while a long batch runs. Other
    streams (StringIO, captured output) get write + flush.

    Lines in the OS survive a crash of the process but not of the machine. An fsync per
    line costs milliseconds, more than a small result takes to produce, so a regular file
    is fsynced at most every `sync_interval_s` (None: never) and by `sync` at the end: a
    power loss then costs at most that much work, which `--resume` redoes.

    A BrokenPipeError (consumer went away, e.g. `| head`) propagates unchanged so the CLI
    can exit quietly.
    """

    def __init__(self, stream: IO[str], *, sync_interval_s: float | None = None) -> None:
        self.stream = stream
        self.written = 0
        self.errors = 0
        self.fd = self._descriptor(stream)
        self.sync_interval_s = sync_interval_s
        self._syncable = self.fd is not None and stat.S_ISREG(os.fstat(self.fd).st_mode)
        self._synced_at = time.monotonic()
        self._unsynced = False

    @staticmethod
    def _descriptor(stream: IO[str]) -> int | None:
        try:
            fd = stream.fileno()
            stream.flush()  # whatever the stream buffered before goes out first
        except (AttributeError, OSError, ValueError):  # no real file behind it
            return None
        return fd

    def write(self, result: Mapping[str, Any]) -> None:
        line = _dumps(result) + "\n"
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (from a "\ud800" escape in the input): backslashreplace
            # writes it back as that same JSON escape instead of failing the run.
            data = line.encode("utf-8", "backslashreplace")
            line = data.decode("utf-8")
        if self.fd is None:
            self.stream.write(line)
            self.stream.flush()
        else:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            self._unsynced = True
            if (self.sync_interval_s is not None
                    and time.monotonic() - self._synced_at >= self.sync_interval_s):
                self.sync()
        self.written += 1
        if result.get("finish_reason") == "error":
            self.errors += 1

    def sync(self) -> None:
        """fsync what was written, where the output is a regular file."""
        if not (self._syncable and self._unsynced):
            return
        try:
            os.fsync(self.fd)  # type: ignore[arg-type]
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise
            self._syncable = False  # a file system that cannot sync: the OS has the lines
        self._unsynced = False
        self._synced_at = time.monotonic()


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
