"""Input parsing is where users meet the tool: every bad line must become a BadLine
whose type a script can branch on and whose message a person can act on, and good
lines must keep flowing around bad ones."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aici_cli.core.config import JobDefaults
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import UsageError
from aici_cli.core.job import BadLine, Job, error_result
from aici_cli.core.sampling import Sampling
from aici_cli.formats.jobs import open_input, read_jobs
from aici_cli.run.result_writer import ResultWriter

DEFAULTS = JobDefaults()


def _read(lines: list[str | bytes], defaults: JobDefaults = DEFAULTS) -> list[Job | BadLine]:
    return list(read_jobs(lines, defaults))


def _one(line: str | bytes, defaults: JobDefaults = DEFAULTS) -> Job | BadLine:
    items = _read([line], defaults)
    assert len(items) == 1
    return items[0]


def _error(line: str | bytes) -> BadLine:
    item = _one(line)
    assert isinstance(item, BadLine), item
    return item


def _job(line: str | bytes, defaults: JobDefaults = DEFAULTS) -> Job:
    item = _one(line, defaults)
    assert isinstance(item, Job), item
    return item


# ------------------------------------------------------------------ bad lines


@pytest.mark.parametrize(
    ("line", "type_", "fragments"),
    [
        ('{"prompt": "x",', "invalid_json", ["invalid JSON", "column 16"]),
        ("prompt: x", "invalid_json", ["invalid JSON", "column 1"]),
        ('{"prompt": "x", "temperature": NaN}', "invalid_json", ["NaN"]),
        ('["prompt"]', "invalid_line", ["expected a JSON object", "got array"]),
        ('"just a string"', "invalid_line", ["expected a JSON object", "got string"]),
        ("42", "invalid_line", ["got integer"]),
        ('{"promt": "hi"}', "invalid_line", ["unknown field 'promt'"]),
        (
            '{"prompt": "hi", "max_tokens": "ten"}',
            "invalid_line",
            ["field 'max_tokens' must be integer", 'got "ten"'],
        ),
        (
            '{"prompt": "hi", "max_tokens": 2.5}',
            "invalid_line",
            ["field 'max_tokens' must be integer", "got 2.5"],
        ),
        ('{"prompt": "hi", "max_tokens": true}', "invalid_line", ["must be integer, got true"]),
        ('{"prompt": 5}', "invalid_line", ["field 'prompt' must be string, got 5"]),
        ('{"prompt": "hi", "stop": "x"}', "invalid_line", ["field 'stop' must be array"]),
        (
            '{"prompt": "hi", "controller_arg": 1}',
            "invalid_line",
            ["field 'controller_arg' must be string or object, got 1"],
        ),
        ('{"id": "a"}', "invalid_line", ["exactly one of 'prompt' or 'messages' is required"]),
        (
            '{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
            "invalid_line",
            ["exactly one of 'prompt' or 'messages'", "got both"],
        ),
        ('{"prompt": ""}', "empty_prompt", ["field 'prompt' must not be empty"]),
        ('{"prompt": "  \\t\\n "}', "empty_prompt", ["field 'prompt' must not be empty"]),
        (
            '{"prompt": "hi", "max_tokens": 0}',
            "invalid_line",
            ["field 'max_tokens' must be >= 1, got 0"],
        ),
        (
            '{"prompt": "hi", "max_tokens": 1000001}',
            "invalid_line",
            ["field 'max_tokens' must be <= 1000000"],
        ),
        ('{"prompt": "hi", "temperature": -1}', "invalid_line", ["'temperature' must be >= 0"]),
        ('{"prompt": "hi", "top_p": 0}', "invalid_line", ["field 'top_p' must be > 0, got 0"]),
        ('{"prompt": "hi", "seed": -3}', "invalid_line", ["field 'seed' must be >= 0"]),
        ('{"prompt": "hi", "stop": [""]}', "invalid_line", ["field 'stop[0]' must not be empty"]),
        (
            '{"prompt": "hi", "stop": ' + json.dumps(["s"] * 17) + "}",
            "invalid_line",
            ["field 'stop' must have at most 16 items, got 17"],
        ),
        ('{"messages": []}', "invalid_line", ["field 'messages' must not be empty"]),
        (
            '{"messages": [{"role": "user"}]}',
            "invalid_line",
            ["field 'messages[0]' is missing required field 'content'"],
        ),
        (
            '{"messages": [{"role": "user", "content": "c", "name": "x"}]}',
            "invalid_line",
            ["unknown field 'name' in 'messages[0]'"],
        ),
        ('{"prompt": "hi", "choices": []}', "invalid_line", ["field 'choices' must not be empty"]),
        (
            '{"prompt": "hi", "json_schema": {"type": 12}}',
            "invalid_schema",
            ["'json_schema' is not a valid JSON Schema", "'type'", "12"],
        ),
        (
            '{"prompt": "hi", "json_schema": {"properties": {"a": {"minimum": "x"}}}}',
            "invalid_schema",
            ["properties.a.minimum", "'x' is not of type 'number'"],
        ),
        (
            '{"prompt": "hi", "json_schema": {"$schema": "https://example.com/s"}}',
            "invalid_schema",
            ["unknown '$schema'"],
        ),
        (
            '{"prompt": "hi", "regex": "(ab"}',
            "invalid_regex",
            ["'regex' is not a valid regular expression", "missing )"],
        ),
        (
            '{"prompt": "hi", "regex": "a", "choices": ["a"]}',
            "invalid_line",
            ["at most one of 'json_schema', 'regex', 'choices' or 'grammar'",
             "got 'regex' and 'choices'"],
        ),
        (
            '{"prompt": "hi", "json_schema": {}, "regex": "a", "choices": ["a"]}',
            "invalid_line",
            ["got 'json_schema', 'regex' and 'choices'"],
        ),
        (b'{"prompt": "caf\xe9"}', "invalid_utf8", ["invalid UTF-8", "byte 16"]),
        ("[" * 100_000, "too_deep", ["nested too deeply", "limit of 100 levels"]),
    ],
)
def test_bad_line_gives_typed_error_naming_line_and_problem(
    line: str | bytes, type_: str, fragments: list[str]
) -> None:
    items = _read(['{"prompt": "ok"}', "", line])  # bad line is physical line 3
    assert isinstance(items[0], Job)
    err = items[1]
    assert isinstance(err, BadLine)
    assert err.type == type_
    assert err.index == 3
    assert err.message.startswith("line 3: ")
    for fragment in fragments:
        assert fragment in err.message
    assert "\n" not in err.message


def test_unknown_field_wins_over_the_prompt_rule_it_causes() -> None:
    # Without the ranking the user would be told prompt is missing, not that they typo'd.
    assert _error('{"promt": "hi"}').message == (
        "line 1: unknown field 'promt' (did you mean 'prompt'?)")


def test_several_unknown_fields_are_all_named() -> None:
    msg = _error('{"prompt": "x", "zz": 1, "aa": 2}').message
    assert msg == "line 1: unknown fields 'aa' and 'zz'"


def test_error_carries_the_line_id_when_readable() -> None:
    assert _error('{"id": "q1", "prompt": ""}').id == "q1"
    assert _error('{"id": "q2", "prompt": "x", "regex": "("}').id == "q2"
    assert _error('{"id": "q3", "prompt": "x", "json_schema": {"type": 1}}').id == "q3"
    assert _error('{"id": "q4", "promt": "x"}').id == "q4"


def test_error_id_falls_back_to_index_when_unreadable() -> None:
    items = _read(["", "{bad", '{"id": 7.5, "prompt": "x"}', b"\xff\xfe",
                   '{"id": true, "prompt": "x"}'])
    assert [(e.index, e.id) for e in items if isinstance(e, BadLine)] == [
        (2, "2"),
        (3, "3"),
        (4, "4"),
        (5, "5"),
    ]


def test_an_integer_id_is_kept_as_given() -> None:
    [job, error] = _read(['{"id": 7, "prompt": "x"}', '{"id": 12345678901234567890, "promt": 1}'])
    assert isinstance(job, Job) and job.id == 7
    assert isinstance(error, BadLine) and error.id == 12345678901234567890


def test_good_lines_around_bad_ones_keep_their_indexes() -> None:
    lines: list[str | bytes] = [
        '{"prompt": "one"}',
        "not json",
        "",
        '{"prompt": "four"}',
        b"\xc3\x28",
        b'{"prompt": "six"}\n',
        '{"prompt": "seven", "top_p": 2}',
        '{"prompt": "eight"}\r\n',
    ]
    items = _read(lines)
    summary = [(i.index, i.prompt if isinstance(i, Job) else i.type) for i in items]
    assert summary == [
        (1, "one"),
        (2, "invalid_json"),
        (4, "four"),
        (5, "invalid_utf8"),
        (6, "six"),
        (7, "invalid_line"),
        (8, "eight"),
    ]


# ------------------------------------------------------------------ good lines


def test_blank_lines_are_skipped_but_counted() -> None:
    items = _read(["\n", "   \t ", '{"prompt": "a"}', "", b"  \n", '{"prompt": "b"}\n', ""])
    assert [(i.index, i.id) for i in items] == [(3, "3"), (6, "6")]


def test_id_defaults_to_line_number_and_duplicates_are_allowed() -> None:
    items = _read(['{"prompt": "a"}', '{"id": "x", "prompt": "b"}', '{"id": "x", "prompt": "c"}'])
    assert all(isinstance(i, Job) for i in items)
    assert [(i.index, i.id) for i in items] == [(1, "1"), (2, "x"), (3, "x")]


def test_defaults_apply_when_line_is_silent() -> None:
    defaults = JobDefaults(
        max_tokens=32,
        sampling=Sampling(temperature=0.7, top_p=0.9, seed=11),
        stop=("END",),
        constraint=Constraint("regex", "[a-z]+"),
    )
    job = _job('{"prompt": "hello"}', defaults)
    assert job == Job(
        index=1,
        id="1",
        prompt="hello",
        messages=None,
        max_tokens=32,
        sampling=Sampling(temperature=0.7, top_p=0.9, seed=11),
        stop=("END",),
        constraint=Constraint("regex", "[a-z]+"),
        extra={},
    )


def test_line_values_override_defaults() -> None:
    defaults = JobDefaults(
        max_tokens=32,
        sampling=Sampling(temperature=0.7, top_p=0.9, seed=11),
        stop=("END",),
        constraint=Constraint("regex", "[a-z]+"),
    )
    line = {
        "id": "mine",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 1,
        "seed": 2**63 - 1,
        "stop": [],
        "choices": ["yes", "no"],
        "controller_arg": {"mode": "strict"},
    }
    job = _job(json.dumps(line), defaults)
    assert job.id == "mine"
    assert job.prompt is None
    assert job.messages == line["messages"]
    sampling = job.sampling
    assert (job.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (
        5, 0.0, 1.0, 2**63 - 1)
    assert isinstance(sampling.temperature, float) and isinstance(sampling.top_p, float)
    assert job.stop == ()
    assert job.constraint == Constraint("choice", ["yes", "no"])
    assert job.extra == {"controller_arg": {"mode": "strict"}}


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        (
            "json_schema",
            {"type": "object", "required": ["a"]},
            Constraint("json_schema", {"type": "object", "required": ["a"]}),
        ),
        ("regex", "[0-9]{3}", Constraint("regex", "[0-9]{3}")),
        ("choices", ["a", "b"], Constraint("choice", ["a", "b"])),
    ],
)
def test_line_constraint_replaces_default(field: str, value: Any, expected: Constraint) -> None:
    defaults = JobDefaults(constraint=Constraint("regex", "default"))
    assert _job(json.dumps({"prompt": "p", field: value}), defaults).constraint == expected


def test_no_constraint_anywhere_gives_none() -> None:
    assert _job('{"prompt": "p"}').constraint is None


def test_json_schema_with_known_dialect_is_accepted() -> None:
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}
    assert _job(json.dumps({"prompt": "p", "json_schema": schema})).constraint == Constraint(
        "json_schema", schema
    )


def test_integral_float_counts_as_integer() -> None:
    job = _job('{"prompt": "p", "max_tokens": 8.0, "seed": 3.0}')
    assert (job.max_tokens, job.sampling.seed) == (8, 3)
    assert isinstance(job.max_tokens, int) and isinstance(job.sampling.seed, int)


def test_string_controller_arg_is_carried() -> None:
    assert _job('{"prompt": "p", "controller_arg": "raw"}').extra == {"controller_arg": "raw"}


def test_bytes_and_unicode_decode() -> None:
    job = _job('{"prompt": "héllo ✓"}\n'.encode())
    assert job.prompt == "héllo ✓"


def test_utf8_bom_on_first_line_is_tolerated() -> None:
    items = _read(['\ufeff{"prompt": "a"}', b'{"prompt": "b"}'])
    assert [i.prompt for i in items if isinstance(i, Job)] == ["a", "b"]
    assert _read([b'\xef\xbb\xbf{"prompt": "c"}'])[0] == _job('{"prompt": "c"}')


def test_read_jobs_is_lazy() -> None:
    consumed: list[int] = []

    def source() -> Iterator[str]:
        for n in range(1, 4):
            consumed.append(n)
            yield json.dumps({"prompt": f"p{n}"})

    jobs = read_jobs(source(), DEFAULTS)
    first = next(jobs)
    assert isinstance(first, Job) and first.prompt == "p1"
    assert consumed == [1]
    second = next(jobs)
    assert isinstance(second, Job) and second.index == 2
    assert consumed == [1, 2]


# ------------------------------------------------------------------ writing


class _FlushCounter(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes: list[int] = []  # buffer length at each flush

    def flush(self) -> None:
        self.flushes.append(len(self.getvalue()))
        super().flush()


def test_result_writer_writes_one_flushed_line_per_result() -> None:
    stream = _FlushCounter()
    writer = ResultWriter(stream)
    ok = {"id": "1", "index": 1, "text": "héllo\nworld", "finish_reason": "stop"}
    bad = error_result(BadLine(index=2, id="2", type="invalid_json", message="line 2: x"))

    writer.write(ok)
    assert stream.getvalue().count("\n") == 1
    assert stream.flushes == [len(stream.getvalue())]
    writer.write(bad)

    lines = stream.getvalue().split("\n")
    assert lines[-1] == ""
    assert [json.loads(line) for line in lines[:-1]] == [ok, bad]
    assert lines[0] == '{"id":"1","index":1,"text":"héllo\\nworld","finish_reason":"stop"}'
    assert len(stream.flushes) == 2
    assert (writer.written, writer.errors) == (2, 1)


def test_result_writer_keeps_unicode_line_separators_inside_one_line() -> None:
    stream = io.StringIO()
    ResultWriter(stream).write({"text": "a\u2028b\u2029c\x85d"})
    out = stream.getvalue()
    assert len(out.splitlines()) == 1
    assert json.loads(out) == {"text": "a\u2028b\u2029c\x85d"}


def test_result_writer_replaces_non_finite_floats() -> None:
    stream = io.StringIO()
    ResultWriter(stream).write({"stats": {"ttft_ms": float("nan"), "total_ms": 1.0}})
    assert json.loads(stream.getvalue()) == {"stats": {"ttft_ms": None, "total_ms": 1.0}}


def test_result_writer_lets_broken_pipe_through() -> None:
    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    writer = ResultWriter(Broken())
    with pytest.raises(BrokenPipeError):
        writer.write({"id": "1"})
    assert (writer.written, writer.errors) == (0, 0)


# ------------------------------------------------------------------ input


def test_open_input_dash_is_stdin_bytes() -> None:
    assert open_input("-") is sys.stdin.buffer


def test_open_input_reads_file_as_bytes(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "b"}\n')
    with open_input(str(path)) as f:
        items = list(read_jobs(f, DEFAULTS))
    assert [(i.index, i.prompt) for i in items if isinstance(i, Job)] == [(1, "a"), (3, "b")]


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_open_input_unreadable_raises_usage_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "nope.jsonl" if kind == "missing" else tmp_path
    with pytest.raises(UsageError) as info:
        open_input(str(path))
    message = str(info.value)
    assert str(path) in message
    assert "\n" not in message
