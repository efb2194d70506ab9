"""Hostile input lines: whatever a line holds, it becomes exactly one Job or one BadLine
with a precise message, fast, and the good lines around it are untouched.

The property tests feed `read_jobs` thousands of generated lines: arbitrary bytes,
arbitrary JSON, objects with the real field names and wrong or extreme values, random
schemas, and valid lines with bytes mutated. The end-to-end test runs a fixed sample of
them, plus the classic cases (10 MB strings, NUL bytes, bad UTF-8, unresolvable and
recursive schemas, ...), through the real CLI on the tiny model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from paths import ROOT

from aici_cli.core.config import MIB, JobDefaults
from aici_cli.core.job import BadLine, Job
from aici_cli.formats.jobs import read_jobs

DEFAULTS = JobDefaults()

# Generated lines fed to the parser, by test; reported at the end of the module.
TRIED: Counter[str] = Counter()

# Every error type the parser may give; anything else (above all "internal_error") means
# a check let an exception through.
PARSER_ERROR_TYPES = {
    "line_too_large",
    "invalid_utf8",
    "invalid_json",
    "too_deep",
    "invalid_unicode",
    "invalid_line",
    "empty_prompt",
    "schema_too_large",
    "constraint_too_large",
    "invalid_schema",
    "invalid_regex",
}

FUZZ = settings(
    deadline=None,
    database=None,  # keep no example files in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def _report_lines_tried(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not TRIED:
        return
    detail = ", ".join(f"{name} {n:,}" for name, n in sorted(TRIED.items()))
    with capture.global_and_fixture_disabled():  # shown even when output is captured
        reporter.write_line(f"\ntest_fuzz_input: {sum(TRIED.values()):,} generated lines "
                            f"tried ({detail})")


# ----------------------------------------------------------------------- strategies

FIELDS = ["id", "prompt", "messages", "json_schema", "regex", "choices", "max_tokens",
          "temperature", "top_p", "seed", "stop", "controller_arg"]

# Any code point, lone surrogates included (Hypothesis leaves them out by default).
any_char = st.characters(exclude_categories=())
texts = st.text(any_char, max_size=12)
plain_texts = st.text(st.characters(codec="utf-8"), max_size=12)  # no lone surrogates

extreme_numbers = st.sampled_from([
    0, -1, 1, 2, 10**6, 10**6 + 1, 10**12, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63),
    10**40, 0.0, -0.0, 0.5, 1.0, 1.5, 2.5, 10.0, 10.5, 1e-300, 5e-324, 1e308, -1e308,
    math.nan, math.inf, -math.inf,
])
numbers = extreme_numbers | st.integers() | st.floats()

json_scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)

refs = st.sampled_from([
    "#", "#/nope", "#/$defs/a", "#/$defs/b", "#/definitions/a", "#/properties/a", "#a",
    "##", "", "http://example.com/s.json", "other.json#/x", "#/%25", "#/$defs/a/items",
])
patterns = st.sampled_from([
    "^[a-z]+$", "(ab", "a{4294967295}", "(a{1000}){1000}", "\\p{L}", "(?!a)b", "\\u0000",
    "[^\\u0000-\\uffff]", "(a|b)*c{2,1}", "",
])
schema_types = st.sampled_from(
    ["string", "integer", "number", "object", "array", "boolean", "null", "nonsense", 12]
)


def _schemas(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={
        "type": schema_types | st.lists(schema_types, max_size=3),
        "properties": st.dictionaries(st.sampled_from(["a", "b", "c"]) | plain_texts, inner,
                                      max_size=3),
        "required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
        "items": inner,
        "$ref": refs,
        "$dynamicRef": refs,
        "$defs": st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
        "allOf": st.lists(inner, max_size=3),
        "anyOf": st.lists(inner, max_size=3),
        "oneOf": st.lists(inner, max_size=3),
        "not": inner,
        "enum": st.lists(json_scalars, max_size=3),
        "const": json_scalars,
        "minimum": numbers,
        "maximum": numbers,
        "minLength": extreme_numbers,
        "maxLength": extreme_numbers,
        "minItems": extreme_numbers,
        "pattern": patterns,
        "additionalProperties": st.booleans() | inner,
        "$schema": st.sampled_from([
            "https://json-schema.org/draft/2020-12/schema",
            "http://json-schema.org/draft-07/schema#", "https://example.com/s", 5,
        ]),
    })


# Deferred: the repr of a recursive strategy grows with every level, and Hypothesis
# warns when it has to build a large one.
json_schemas: st.SearchStrategy[Any] = st.deferred(
    lambda: st.recursive(st.just({}) | st.booleans(), _schemas, max_leaves=8)
)

good_prompts = plain_texts.filter(lambda s: s.strip() != "").map(lambda s: "p " + s)
good_options: dict[str, st.SearchStrategy[Any]] = {
    "id": plain_texts,
    "max_tokens": st.integers(1, 4),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 10]),
    "top_p": st.sampled_from([1, 0.5, 1e-9]),
    "seed": st.sampled_from([0, 1, 2**63 - 1]) | st.integers(0, 2**63 - 1),
    "stop": st.lists(plain_texts.filter(bool), max_size=3),
}
GOOD_CONSTRAINTS: list[dict[str, Any]] = [
    {},
    {"choices": ["yes", "no"]},
    {"regex": "[a-z]{1,3}"},
    {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"]}},
    {"json_schema": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}},
]


@st.composite
def good_lines(draw: st.DrawFn) -> dict[str, Any]:
    """A line that must parse to a Job (cheap to run: at most 4 tokens)."""
    line: dict[str, Any] = {"prompt": draw(good_prompts)}
    if draw(st.booleans()):
        line = {"messages": [{"role": "user", "content": line["prompt"]}]}
    for name, values in good_options.items():
        if draw(st.booleans()):
            line[name] = draw(values)
    line.setdefault("max_tokens", draw(st.integers(1, 4)))
    line.update(draw(st.sampled_from(GOOD_CONSTRAINTS)))
    return line


def _dump(value: Any, ascii_only: bool = True) -> bytes:
    """JSON bytes as a user's tool might write them: NaN/Infinity allowed through, lone
    surrogates either escaped or written raw (which makes the bytes invalid UTF-8)."""
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def _mutate(line: bytes, where: int, kind: int, payload: bytes) -> bytes:
    """One edit of a valid line at a position: the near-misses users actually produce."""
    at = where % (len(line) + 1)
    edits = [
        line[:at] + payload + line[at:],  # insert bytes
        line[:at] + line[at + 1 :],  # delete a byte
        line[:at],  # truncate
        line[:at] + payload + line[at + len(payload) :],  # overwrite
        line[:at] + b'\\ud800' + line[at:],  # a lone surrogate escape
        line[:at] + b"\x00" + line[at:],  # a raw NUL byte
        line[:at] + b"\xff\xfe" + line[at:],  # bytes that are never UTF-8
        line[:at] + b"[" * 200 + line[at:],  # deep nesting
        line + line,  # two objects on one line
    ]
    return edits[kind % len(edits)]


arbitrary_bytes = st.binary(max_size=120)
arbitrary_json = st.builds(_dump, json_values, st.booleans())
field_objects = st.builds(
    _dump,
    st.dictionaries(
        st.sampled_from(FIELDS) | texts,
        json_values | numbers | json_schemas | st.lists(texts, max_size=3),
        max_size=6,
    ),
    st.booleans(),
)
hostile_options = st.builds(
    _dump,
    st.fixed_dictionaries({"prompt": st.just("hi")}, optional={
        "max_tokens": numbers | json_scalars,
        "temperature": numbers | json_scalars,
        "top_p": numbers | json_scalars,
        "seed": numbers | json_scalars,
        "stop": st.lists(texts, max_size=20) | json_scalars,
        "id": json_scalars,
        "choices": st.lists(texts, max_size=4) | json_scalars,
        "regex": patterns | json_scalars,
    }),
)
schema_lines = st.builds(
    _dump, st.fixed_dictionaries({"prompt": st.just("p"), "json_schema": json_schemas})
)
mutated_lines = st.builds(
    _mutate,
    st.builds(_dump, good_lines()),
    st.integers(0, 10**4),
    st.integers(0, 100),
    st.binary(min_size=1, max_size=4),
)
blank_lines = st.sampled_from([b"", b"\n", b"  \t ", b"\r\n", "\u3000\u2028".encode()])


def _one_physical_line(raw: bytes) -> bytes:
    """Keep a generated line on one line of a file: a newline would split it in two."""
    return raw.replace(b"\n", b" ")


hostile_lines = st.one_of(
    arbitrary_bytes, arbitrary_json, field_objects, hostile_options, schema_lines,
    mutated_lines,
).map(_one_physical_line)


# ------------------------------------------------------------------------- checks


def _is_blank(raw: bytes | str, index: int) -> bool:
    """What counts as no line at all: whitespace only, after a first-line BOM."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return False
    if index == 1:
        text = text.removeprefix("\ufeff")
    return not text.strip()


def _check_items(lines: list[bytes | str], items: list[Job | BadLine]) -> None:
    """One item per non-blank line, in order, each a Job or a precise BadLine."""
    expected = [i for i, raw in enumerate(lines, start=1) if not _is_blank(raw, i)]
    assert [item.index for item in items] == expected
    for item in items:
        if isinstance(item, BadLine):
            assert item.type in PARSER_ERROR_TYPES, item
            assert item.message.startswith(f"line {item.index}: ")
            assert len(item.message) > len(f"line {item.index}: ") + 5
            assert "\n" not in item.message and "\r" not in item.message
            # The line's own id (even "", or an integer as given) or its number.
            assert isinstance(item.id, (str, int)) and not isinstance(item.id, bool)
        else:
            assert isinstance(item, Job), item
            _check_job_in_range(item)


def _check_job_in_range(job: Job) -> None:
    """A line that parsed carries values the engine can run, never an extreme one."""
    assert 1 <= job.max_tokens <= 10**6
    assert 0.0 <= job.sampling.temperature <= 10.0 and math.isfinite(job.sampling.temperature)
    assert 0.0 < job.sampling.top_p <= 1.0
    assert 0 <= job.sampling.seed <= 2**63 - 1
    assert (job.prompt is None) != (job.messages is None)


def _parse(lines: list[bytes | str]) -> list[Job | BadLine]:
    t0 = time.perf_counter()
    items = list(read_jobs(lines, DEFAULTS))
    # Generated lines are small: even the slowest check (a schema) takes milliseconds.
    assert time.perf_counter() - t0 < 5.0 * max(1, len(lines))
    return items


def _as_text_sometimes(raw: bytes, as_text: bool) -> bytes | str:
    """read_jobs also takes str lines (stdin in text mode, tests); those can hold lone
    surrogates as characters, which UTF-8 bytes never can."""
    return raw.decode("utf-8", "surrogatepass") if as_text else raw


# ------------------------------------------------------------------ property tests


@settings(FUZZ, max_examples=500)
@given(
    st.lists(hostile_lines | blank_lines, min_size=1, max_size=12),
    st.booleans(),
)
def _any_lines(lines: list[bytes], as_text: bool) -> None:
    TRIED["any lines"] += len(lines)
    if as_text:
        lines_in: list[bytes | str] = []
        for raw in lines:
            try:
                lines_in.append(_as_text_sometimes(raw, True))
            except UnicodeDecodeError:
                lines_in.append(raw)
    else:
        lines_in = list(lines)
    _check_items(lines_in, _parse(lines_in))


@pytest.mark.heavy
def test_any_lines_become_one_job_or_precise_error_each() -> None:
    before = TRIED["any lines"]
    _any_lines()
    assert TRIED["any lines"] - before >= 1500


@settings(FUZZ, max_examples=300)
@given(
    good_lines(),
    st.lists(hostile_lines, max_size=5),
    st.lists(hostile_lines, max_size=5),
)
def _good_among_hostile(good: dict[str, Any], before: list[bytes], after: list[bytes]) -> None:
    TRIED["good among hostile"] += 1 + len(before) + len(after)
    raw = _dump(good)
    alone = _parse([raw])
    assert len(alone) == 1 and isinstance(alone[0], Job), (good, alone)
    lines: list[bytes | str] = [*before, raw, *after]
    items = _parse(lines)
    _check_items(lines, items)
    index = len(before) + 1
    mixed = next(item for item in items if item.index == index)
    expected = dataclasses.replace(alone[0], index=index, id=good.get("id", str(index)))
    assert mixed == expected


@pytest.mark.heavy
def test_good_lines_parse_the_same_among_hostile_ones() -> None:
    before = TRIED["good among hostile"]
    _good_among_hostile()
    assert TRIED["good among hostile"] - before >= 900


OPTION_RANGES: dict[str, tuple[float, float]] = {
    "max_tokens": (1, 10**6),
    "temperature": (0, 10),
    "top_p": (0, 1),
    "seed": (0, 2**63 - 1),
}


@settings(FUZZ, max_examples=400)
@given(st.sampled_from(sorted(OPTION_RANGES)), numbers | json_scalars)
def _one_option(name: str, value: Any) -> None:
    TRIED["one option"] += 1
    [item] = _parse([_dump({"prompt": "hi", name: value})])
    if isinstance(item, Job):
        low, high = OPTION_RANGES[name]
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
        assert low <= value <= high
        return
    assert isinstance(item, BadLine)
    if isinstance(value, float) and not math.isfinite(value):
        assert item.type == "invalid_json"  # NaN and Infinity are not JSON
        assert "not valid JSON" in item.message
    else:
        assert item.type in ("invalid_line", "invalid_unicode")  # a lone surrogate
        assert f"field '{name}'" in item.message  # names the field the user got wrong


def test_each_out_of_range_option_is_refused_by_name() -> None:
    before = TRIED["one option"]
    _one_option()
    assert TRIED["one option"] - before >= 300


# ------------------------------------------------------------------ explicit cases


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _ref_chain(length: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _line(**fields: Any) -> bytes:
    return json.dumps({"prompt": "hi", **fields}).encode()


# (line, error type or None for a Job, fragments of the message)
EXPLICIT: list[tuple[str, bytes, str | None, list[str]]] = [
    ("10 MB string", _line(id="big", prompt="x" * 10_000_000), "line_too_large",
     ["10,000,", "over the limit of 8,388,608 bytes (8 MiB)"]),
    ("raw NUL in a string", b'{"prompt": "a\x00b"}', "invalid_json",
     ["unescaped control character U+0000", "column 14"]),
    ("raw NUL outside strings", b'\x00{"prompt": "a"}', "invalid_json", ["U+0000"]),
    ("escaped NUL", _line(prompt="a\u0000b", stop=["\u0000"]), None, []),
    ("invalid UTF-8", b'{"prompt": "caf\xe9"}', "invalid_utf8", ["byte 16"]),
    ("UTF-8 of a surrogate", b'{"prompt": "\xed\xa0\x80"}', "invalid_utf8", ["byte 13"]),
    ("lone surrogate escape", b'{"id": "s", "prompt": "\\udc00"}', "invalid_unicode",
     ["field 'prompt'", "lone surrogate \\udc00"]),
    ("surrogate in a schema key", _line(json_schema={"properties": {"\ud800": {}}}),
     "invalid_unicode", ["field name in 'json_schema.properties'"]),
    ("unresolvable $ref", _line(json_schema={"$ref": "#/nope"}), "invalid_schema",
     ["$ref '#/nope' cannot be resolved", "no such location"]),
    ("remote $ref", _line(json_schema={"$ref": "http://example.com/s.json"}),
     "invalid_schema", ["never fetched"]),
    ("unresolvable $dynamicRef", _line(json_schema={"$dynamicRef": "#nope"}),
     "invalid_schema", ["$dynamicRef '#nope'", "no such anchor"]),
    ("nested unresolvable $ref",
     _line(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}),
     "invalid_schema", ["'#/$defs/x'"]),
    ("recursive schema",
     _line(json_schema={"type": "array", "items": {"$ref": "#"}}), None, []),
    ("recursive schema that cannot end",
     _line(json_schema={"type": "object", "properties": {"a": {"$ref": "#"}},
                        "required": ["a"]}), None, []),
    ("schema that is its own $ref", _line(json_schema={"$ref": "#"}), "invalid_schema",
     ["$ref '#' loops back", "endless recursion"]),
    ("mutually recursive refs",
     _line(json_schema={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                        "$ref": "#/$defs/a"}), "invalid_schema", ["$ref '#/$defs/a' loops back"]),
    ("reference chain over the limit", _line(json_schema=_ref_chain(150)), "too_deep",
     ["chains 152 schemas", "over the limit of 100"]),
    ("unsatisfiable allOf",
     _line(json_schema={"allOf": [{"type": "string"}, {"type": "integer"}]}), None, []),
    ("unsatisfiable not", _line(json_schema={"not": {}}), None, []),
    ("schema over 1 MiB",
     _line(json_schema={"enum": [f"value-{i:07d}" for i in range(80_000)]}),
     "schema_too_large", ["field 'json_schema' is 1,", "over the limit of 1,048,576 bytes"]),
    ("choices over 1 MiB", _line(choices=["c" * 100] * 11_000), "constraint_too_large",
     ["field 'choices'"]),
    ("schema 150 levels deep", _line(json_schema=_deep_schema(75)), "too_deep",
     ["nested 152 levels deep in field 'json_schema'", "limit of 100 levels"]),
    ("100000 brackets", b"[" * 100_000, "too_deep", ["limit of 100 levels"]),
    ("schema at the depth limit", _line(json_schema=_deep_schema(49)), None, []),
    ("max_tokens 0", _line(max_tokens=0), "invalid_line", ["'max_tokens' must be >= 1, got 0"]),
    ("max_tokens 10**12", _line(max_tokens=10**12), "invalid_line",
     ["'max_tokens' must be <= 1000000, got 1000000000000"]),
    ("negative temperature", _line(temperature=-0.5), "invalid_line",
     ["'temperature' must be >= 0, got -0.5"]),
    ("top_p 0", _line(top_p=0), "invalid_line", ["'top_p' must be > 0"]),
    ("top_p 1.5", _line(top_p=1.5), "invalid_line", ["'top_p' must be <= 1"]),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', "invalid_json", ["NaN is not valid"]),
    ("Infinity", b'{"prompt": "hi", "top_p": -Infinity}', "invalid_json", ["-Infinity"]),
    ("1e400", b'{"prompt": "hi", "temperature": 1e400}', "invalid_json",
     ["number 1e400 is out of range"]),
    ("seed 2**64", _line(seed=2**64), "invalid_line", ["'seed' must be <= 9223372036854775807"]),
    ("seed of 5000 digits", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
     "invalid_json", ["integer with 5,000 digits", "limit of 4,300 digits"]),
    ("max_tokens as a string", _line(max_tokens="10"), "invalid_line",
     ["field 'max_tokens' must be integer, got \"10\""]),
    ("wrong-typed messages", b'{"messages": [{"role": 1, "content": []}]}', "invalid_line",
     ["messages[0]"]),
    ("unterminated string", b'{"prompt": "hi', "invalid_json",
     ["Unterminated string starting at column 12"]),
    ("cut-off line with its newline", b'{"prompt": "hi"\r\n', "invalid_json",
     ["Expecting ',' delimiter at column 16"]),
]


@pytest.mark.parametrize(("line", "type_", "fragments"), [c[1:] for c in EXPLICIT],
                         ids=[c[0] for c in EXPLICIT])
def test_explicit_hostile_line(line: bytes, type_: str | None, fragments: list[str]) -> None:
    TRIED["explicit"] += 1
    t0 = time.perf_counter()
    items = _parse([b'{"prompt": "ok"}', line, b'{"prompt": "ok"}'])
    assert time.perf_counter() - t0 < 5.0  # refused cheaply, however large
    _check_items([b"x", line, b"x"], items)
    assert isinstance(items[0], Job) and isinstance(items[2], Job)
    item = items[1]
    if type_ is None:
        assert isinstance(item, Job), item
        return
    assert isinstance(item, BadLine), item
    assert item.type == type_
    for fragment in fragments:
        assert fragment in item.message


def test_duplicate_ids_each_get_their_own_item() -> None:
    items = _parse([_line(id="dup"), _line(id="dup", max_tokens=0), _line(id="dup")])
    assert [(i.index, i.id, type(i).__name__) for i in items] == [
        (1, "dup", "Job"), (2, "dup", "BadLine"), (3, "dup", "Job")]


def test_limits_are_settings() -> None:
    tight = JobDefaults(max_line_bytes=100, max_constraint_bytes=20, max_depth=3)
    items = list(read_jobs([
        _line(prompt="x" * 200),
        _line(choices=["a" * 30]),
        _line(controller_arg={"a": {"b": {}}}),
        _line(controller_arg={"a": 1}),
    ], tight))
    assert [getattr(i, "type", "job") for i in items] == [
        "line_too_large", "constraint_too_large", "too_deep", "job"]
    assert "over the limit of 100 bytes" in items[0].message  # type: ignore[union-attr]
    assert "over the limit of 20 bytes" in items[1].message  # type: ignore[union-attr]
    assert "nested 4 levels deep in field 'controller_arg'" in items[2].message  # type: ignore[union-attr]


def test_size_limit_counts_utf8_bytes_without_the_line_ending() -> None:
    limits = JobDefaults(max_line_bytes=MIB)
    body = '{"prompt": "' + "é" * ((MIB - 14) // 2) + '"}'
    assert len(body.encode()) == MIB
    for raw in (body, body + "\n", body.encode() + b"\r\n"):
        assert isinstance(next(read_jobs([raw], limits)), Job)
    over = body.replace('"}', 'x"}')
    err = next(read_jobs([over + "\n"], limits))
    assert isinstance(err, BadLine) and err.type == "line_too_large"
    assert f"line is {MIB + 1:,} bytes" in err.message


# ------------------------------------------------------------------- end to end


def _fixed_sample(n: int) -> list[bytes]:
    """`n` hostile lines drawn from the strategies above, the same on every run.

    Derandomized Hypothesis draws; its first example is the all-minimal one, so it is
    skipped to get varied lines.
    """
    drawn: list[list[bytes]] = []

    @settings(max_examples=n // 10 + 2, derandomize=True, database=None,
              phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(hostile_lines, min_size=10, max_size=10))
    def draw(lines: list[bytes]) -> None:
        drawn.append(lines)

    draw()
    sample = [line for batch in drawn[1:] for line in batch]
    # Valid Jobs in the sample must stay cheap to run: cap what they may generate.
    return [_cap_tokens(line) for line in sample[:n]]


def _cap_tokens(raw: bytes) -> bytes:
    """A sampled line that may generate hundreds of tokens gets max_tokens 8 instead (past
    the model's 2048 positions it is a quick error either way)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    value = obj.get("max_tokens") if isinstance(obj, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 8 < value <= 2048:
        return json.dumps({**obj, "max_tokens": 8}).encode()
    return raw


GOOD_E2E: list[dict[str, Any]] = [
    {"id": "g1", "prompt": "Once upon a time", "max_tokens": 4},
    {"id": "dup", "prompt": "Pick", "choices": ["yes", "no"]},
    {"id": "dup", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3},
    {"id": "g4", "prompt": "Person:", "max_tokens": 12,
     "json_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"]}},
    {"id": "g5", "prompt": "Sample", "max_tokens": 4, "temperature": 0.8, "seed": 7},
]


def _run_cli(model_dir: Path, tmp_path: Path, name: str,
             lines: list[bytes]) -> tuple[int, list[dict[str, Any]], str]:
    src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
    src.write_bytes(b"".join(line + b"\n" for line in lines))
    proc = subprocess.run(
        [sys.executable, "-m", "aici_cli", "run", str(src), "-o", str(out),
         "--model", str(model_dir), "--dtype", "float32", "--device", "cpu",
         "--max-tokens", "4", "-q"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    results = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return proc.returncode, results, proc.stderr


def _comparable(result: dict[str, Any]) -> dict[str, Any]:
    """What must not change with the company a line keeps: all but timings and index."""
    kept = {k: v for k, v in result.items() if k not in ("index", "stats", "input_sha256")}
    kept["tokens"] = (result["stats"]["prompt_tokens"], result["stats"]["output_tokens"])
    return kept


@pytest.mark.subprocess
def test_cli_survives_a_file_of_hostile_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    explicit = [_one_physical_line(line.removesuffix(b"\n")) for _, line, _, _ in EXPLICIT]
    hostile = _fixed_sample(200) + explicit
    assert len(hostile) >= 200
    TRIED["end to end"] += len(hostile)
    good = [json.dumps(g).encode() for g in GOOD_E2E]
    # Good lines first, in the middle and last; one blank line that must get no result.
    lines = [good[0], *hostile[:100], good[1], good[2], b"", *hostile[100:], good[3], good[4]]
    good_at = [1, 102, 103, len(lines) - 1, len(lines)]  # where good[0..4] went
    assert [lines[i - 1] for i in good_at] == good

    code, results, stderr = _run_cli(tiny_model_dir, tmp_path, "mixed", lines)
    assert code == 1, stderr  # errors present: not 0, and not a crash (2 or a traceback)
    assert "Traceback" not in stderr
    by_index = {r["index"]: r for r in results}
    assert len(by_index) == len(results)  # exactly one result per line
    expected = {i for i, raw in enumerate(lines, start=1) if not _is_blank(raw, i)}
    assert set(by_index) == expected

    as_read = [line + b"\n" for line in lines]  # as the CLI reads them from the file
    parsed = {item.index: item for item in read_jobs(as_read, JobDefaults(max_tokens=4))}
    for index, item in parsed.items():
        result = by_index[index]
        if isinstance(item, BadLine):  # refused by the parser: exactly that error
            assert result["finish_reason"] == "error"
            assert result["error"] == {"type": item.type, "message": item.message}
        elif result["finish_reason"] == "error":  # refused later (grammar, prompt length)
            assert result["error"]["type"] not in ("internal_error", ""), result
            assert result["error"]["message"].startswith(f"line {index}: ")
        else:
            assert result["finish_reason"] in ("stop", "length"), result

    code_alone, alone, _ = _run_cli(tiny_model_dir, tmp_path, "good", good)
    assert code_alone == 0
    alone_by_index = {r["index"]: _comparable(r) for r in alone}
    for n, index in enumerate(good_at, start=1):
        assert by_index[index]["finish_reason"] != "error"
        assert _comparable(by_index[index]) == alone_by_index[n]
