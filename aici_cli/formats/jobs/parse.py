"""Input lines in: each physical line becomes a `Job`, a `BadLine`, or nothing (blank).

A bad input line never raises out of `read_jobs`: it becomes a `BadLine` that the
caller writes as an error result, so every input line ends as exactly one result line.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from aici_cli.control.grammar_check import lark_grammar, whitespace_problem
from aici_cli.control.schema_check import json_schema_problem
from aici_cli.control.schema_envelope import inert_problem
from aici_cli.control.schema_envelope import unwrap as unwrap_envelope
from aici_cli.core.config import JobDefaults
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import UsageError
from aici_cli.core.job import BadLine, Job, TranslateError
from aici_cli.core.json_text import json_type
from aici_cli.core.sampling import line_sampling
from aici_cli.formats.jobs.checks import (
    constraint_size_problem,
    decode_line,
    depth_problem,
    ending_length,
    load_json,
    readable_id,
    size_error,
    unicode_problem,
)
from aici_cli.formats.jobs.content_parts import join_text_parts
from aici_cli.formats.jobs.messages import bad_line, describe, error_rank
from aici_cli.formats.jobs.tools import messages_problem, tool_constraint
from aici_cli.formats.schemas import schema_valid, schema_validator

# Maps a parsed line of another format (e.g. an OpenAI batch request) onto this one's
# fields, given the line number; raises ValueError (a `TranslateError` to choose the
# error type) with a message naming the problem.
Translate = Callable[[dict[str, Any], int], dict[str, Any]]


def read_jobs(lines: Iterable[str | bytes], defaults: JobDefaults,
              translate: Translate | None = None) -> Iterator[Job | BadLine]:
    """Yield one Job or BadLine per non-blank line, reading lazily.

    Lazy so that a stream like stdin can be processed while it is still being written;
    `index` counts every physical line (blank ones too) so results point back at the
    exact line in the user's file even when ids are missing or repeated. `translate`
    maps each parsed object from another line format first (see `openai_batch`).
    """
    for index, raw in enumerate(lines, start=1):
        item = _parse_safely(raw, index, defaults, translate)
        if item is not None:
            yield item


def open_input(path: str) -> BinaryIO:
    """Open the JSONL input in binary so bad UTF-8 becomes a per-line error, not a crash
    of the whole run; "-" means stdin, read through a file of its own over a copy of its
    descriptor: a thread may be blocked reading it when the run ends (`live_input`), and
    the interpreter aborts at exit if that is `sys.stdin`'s own buffer. The caller owns
    and closes what it gets, except `sys.stdin.buffer` (stdin without a descriptor)."""
    if path == "-":
        try:
            return open(os.dup(sys.stdin.fileno()), "rb")  # noqa: SIM115
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return sys.stdin.buffer
    try:
        return open(path, "rb")  # the caller owns and closes it
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"cannot read input file '{path}': {reason}") from None


def _parse_safely(raw: str | bytes, index: int, defaults: JobDefaults,
                  translate: Translate | None) -> Job | BadLine | None:
    """`_parse_line`, with any failure it did not foresee confined to its own line: one
    odd line must not end a run of thousands."""
    try:
        return _parse_line(raw, index, defaults, translate)
    except Exception as exc:  # a bug in the checks, reported like the engine reports its own
        problem = f"line could not be read: {type(exc).__name__}: {exc}"
        return bad_line(index, None, "internal_error", problem)


def _parse_line(raw: str | bytes, index: int, defaults: JobDefaults,
                translate: Translate | None = None) -> Job | BadLine | None:
    """Turn one physical line into a Job, a BadLine, or None for a blank line.

    Checks run cheapest first, and each one bounds what the next may cost: size before
    decoding, depth before any recursive walk, constraint size before schema checking.
    """
    text = _line_text(raw, index, defaults)
    if text is None or isinstance(text, BadLine):
        return text
    obj = _line_object(text, index, defaults, translate)
    if isinstance(obj, BadLine):
        return obj
    job = _job(obj, index, defaults)
    if isinstance(job, BadLine) and _asks_for_schema(obj, defaults):
        return dataclasses.replace(job, json_schema=True)
    return job


def _asks_for_schema(obj: dict[str, Any], defaults: JobDefaults) -> bool:
    """Whether the line's constraint is a JSON schema: its own, or --json-schema where
    it names no other."""
    if "json_schema" in obj:
        return True
    own = any(field in obj for field in _KIND_FIELDS.values())
    return not own and defaults.constraint is not None and (
        defaults.constraint.kind == "json_schema")


def _line_text(raw: str | bytes, index: int, defaults: JobDefaults) -> str | BadLine | None:
    """The line as text without its line ending, or None for a blank line."""
    too_large = size_error(raw, index, defaults.max_line_bytes)
    if too_large is not None:
        return too_large
    text = decode_line(raw, index)
    if isinstance(text, BadLine):
        return text
    if index == 1:
        text = text.removeprefix("\ufeff")  # editors on Windows like to add a BOM
    if not text.strip():
        return None
    # json counts columns from the last newline: with the line's own ending still there,
    # an error at the end of the line would be reported at column 1 of a line 2.
    return text[: len(text) - ending_length(text)]


def _line_object(text: str, index: int, defaults: JobDefaults,
                 translate: Translate | None) -> dict[str, Any] | BadLine:
    """The line's JSON object, within the depth limit and valid Unicode, with this
    tool's fields (after `translate`)."""
    obj = load_json(text, index, defaults.max_depth)
    if isinstance(obj, BadLine):
        return obj
    too_deep = depth_problem(obj, text, defaults.max_depth)
    if too_deep is not None:
        return bad_line(index, None, "too_deep", too_deep)
    bad_unicode = unicode_problem(obj, text)
    if bad_unicode is not None:
        id_ = readable_id(obj) if isinstance(obj, dict) else None
        return bad_line(index, id_, "invalid_unicode", bad_unicode)
    if not isinstance(obj, dict):
        problem = f"expected a JSON object, got {json_type(obj)}"
        return bad_line(index, None, "invalid_line", problem)
    if translate is not None:
        try:
            obj = translate(obj, index)
        except ValueError as e:
            custom_id = obj.get("custom_id")
            id_ = custom_id if isinstance(custom_id, str) else None
            type_ = e.type if isinstance(e, TranslateError) else "invalid_request"
            return bad_line(index, id_, type_, str(e))
    return obj


def _job(obj: dict[str, Any], index: int, defaults: JobDefaults) -> Job | BadLine:
    """The Job for a line's object, or the BadLine for the first thing wrong in it."""
    id_ = readable_id(obj)
    # Before validation: validating a million `choices` alone takes seconds.
    oversized = constraint_size_problem(obj, defaults.max_constraint_bytes)
    if oversized is not None:
        return bad_line(index, id_, *oversized)
    if "messages" in obj:  # the OpenAI SDK's list of content parts, as one string
        messages, problem = join_text_parts(obj["messages"])
        if problem is not None:
            return bad_line(index, id_, "invalid_line", problem)
        obj = {**obj, "messages": messages}
    invalid = _validation_error(obj, index, id_)
    if invalid is not None:
        return invalid
    problem = messages_problem(obj["messages"]) if "messages" in obj else None
    if problem is not None:
        return bad_line(index, id_, "invalid_line", problem)
    constraint = _constraint(obj, index, id_, defaults)
    if not isinstance(constraint, BadLine):
        constraint = _json_options(obj, constraint, index, id_)
    if isinstance(constraint, BadLine):
        return constraint

    problem = _fields_problem(obj, constraint, defaults)
    if problem is not None:
        return bad_line(index, id_, "invalid_line", problem)
    return _make_job(obj, index, id_, constraint, defaults)


def _fields_problem(obj: dict[str, Any], constraint: Constraint | None,
                    defaults: JobDefaults) -> str | None:
    """What is wrong with fields that are valid alone but not together (the input-line
    schema cannot say so), or None."""
    score = bool(obj.get("score", defaults.score))
    if score and (constraint is None or constraint.kind != "choice"):
        return "field 'score' needs 'choices' (the options to rank)"
    if score and int(obj.get("n", 1)) > 1:
        return "field 'score' ranks the choices once: 'n' must be 1"
    if "top_logprobs" in obj and not obj.get("logprobs"):
        return "field 'top_logprobs' needs 'logprobs': true"
    max_tokens = int(obj.get("max_tokens", defaults.max_tokens))
    min_tokens = int(obj.get("min_tokens", defaults.sampling.min_tokens))
    if min_tokens > max_tokens:
        return (f"field 'min_tokens' must be at most max_tokens ({max_tokens}), "
                f"got {min_tokens}")
    return None


def _make_job(obj: dict[str, Any], index: int, id_: str | int | None,
              constraint: Constraint | None, defaults: JobDefaults) -> Job:
    """The Job of a checked line: each field the line's own, else the run's default."""
    score = bool(obj.get("score", defaults.score))
    logprobs = int(obj.get("top_logprobs", 0)) if obj.get("logprobs") else None
    if "logprobs" not in obj:
        logprobs = defaults.logprobs
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
        tools=obj.get("tools"),
        max_tokens=int(obj.get("max_tokens", defaults.max_tokens)),
        sampling=line_sampling(obj, defaults.sampling),
        stop=tuple(obj["stop"]) if "stop" in obj else tuple(defaults.stop),
        constraint=constraint,
        extra=extra,
        n=1 if score else int(obj.get("n", defaults.n)),
        score=score,
        answer=obj.get("answer"),
        logprobs=logprobs,
        stop_token_ids=frozenset(int(t) for t in obj.get("stop_token_ids", ())),
        ignore_eos=bool(obj.get("ignore_eos", defaults.ignore_eos)),
        schema_fallback=str(obj.get("schema_fallback", defaults.schema_fallback)),
    )


def _validation_error(obj: dict[str, Any], index: int, id_: str | int | None) -> BadLine | None:
    """Check the line against schemas/input-line.schema.json, reporting the root cause.

    The yes/no check first (`schema_valid`, the validator compiled once): collecting
    every error and ranking them is done only for a line that has one."""
    try:
        if schema_valid("input-line", obj):
            return None
        errors = sorted(schema_validator("input-line").iter_errors(obj), key=error_rank)
    except RecursionError:
        return bad_line(index, id_, "too_deep", "line is nested too deeply to validate")
    if not errors:
        return None
    first = errors[0]
    is_prompt = list(first.path) == ["prompt"] and first.validator in ("minLength", "pattern")
    type_ = "empty_prompt" if is_prompt else "invalid_line"
    return bad_line(index, id_, type_, describe(first))


def _constraint(
    obj: dict[str, Any], index: int, id_: str | int | None, defaults: JobDefaults
) -> Constraint | BadLine | None:
    """The line's own constraint, checked as far as can be without a tokenizer, or the
    default one."""
    tools = tool_constraint(obj, defaults.max_depth)
    if isinstance(tools, tuple):
        return bad_line(index, id_, *tools)
    if tools is not None:
        other = next((k for k in _KIND_FIELDS.values() if k in obj and k != "tools"), None)
        if other is not None:
            choice = json.dumps(obj.get("tool_choice", "auto"))
            return bad_line(index, id_, "invalid_line", (
                f"field 'tools' with 'tool_choice' {choice} constrains the output to tool calls,"
                f" which cannot be combined with '{other}' (a line takes one constraint; "
                "'tool_choice' \"none\" shows the tools without calling them)"))
        return tools
    if "json_schema" in obj:
        schema, _ = unwrap_envelope(obj["json_schema"])  # OpenAI's {name, strict, schema}
        unusable = json_schema_problem(schema, defaults.max_depth)
        if unusable is None:
            inert = inert_problem(schema)
            unusable = None if inert is None else ("invalid_schema", inert)
        if unusable is not None:
            type_, problem = unusable
            return bad_line(index, id_, type_, f"field 'json_schema' {problem}")
        return Constraint("json_schema", schema)
    if "regex" in obj:
        try:
            with warnings.catch_warnings():
                # re warns about constructs like `[[` whose meaning may change: stderr is
                # no place for a note about one line.
                warnings.simplefilter("ignore", FutureWarning)
                re.compile(obj["regex"])
        except (re.error, RecursionError, OverflowError) as exc:
            problem = f"field 'regex' is not a valid regular expression: {exc}"
            return bad_line(index, id_, "invalid_regex", problem)
        return Constraint("regex", obj["regex"])
    if "choices" in obj:
        return Constraint("choice", list(obj["choices"]))
    if "grammar" in obj:
        lark, why = lark_grammar(obj["grammar"])
        if why is not None:
            return bad_line(index, id_, "invalid_grammar",
                              f"field 'grammar' is not a usable grammar: {why}")
        return Constraint("lark", lark)
    return defaults.constraint


# The fields that shape a JSON schema constraint, the line's own or --json-schema.
_JSON_OPTIONS = ("whitespace_pattern", "json_permissive")


def _json_options(obj: dict[str, Any], constraint: Constraint | None, index: int,
                  id_: str | int | None) -> Constraint | BadLine | None:
    """`constraint` with the line's `whitespace_pattern` and `json_permissive` applied;
    they mean something for a JSON schema only."""
    given = [name for name in _JSON_OPTIONS if name in obj]
    if not given:
        return constraint
    if constraint is None or constraint.kind != "json_schema":
        other = "none is given" if constraint is None else (
            f"not to '{_KIND_FIELDS[constraint.kind]}'")
        return bad_line(index, id_, "invalid_line",
                          f"field '{given[0]}' applies to a JSON schema ('json_schema' or "
                          f"--json-schema), {other}")
    if "whitespace_pattern" in obj:
        problem = whitespace_problem(obj["whitespace_pattern"])
        if problem is not None:
            return bad_line(index, id_, "invalid_regex", f"field 'whitespace_pattern' {problem}")
        constraint = dataclasses.replace(constraint, whitespace=obj["whitespace_pattern"])
    if "json_permissive" in obj:
        constraint = dataclasses.replace(constraint, permissive=obj["json_permissive"])
    return constraint


# How a line names each kind of constraint.
_KIND_FIELDS = {"json_schema": "json_schema", "regex": "regex", "choice": "choices",
                "lark": "grammar", "tool_calls": "tools"}
