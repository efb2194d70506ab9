"""The report's check of every result line: jsonschema-rs's fast yes, jsonschema's
verdict otherwise (`aici_cli.formats.schemas.schema_check`), always jsonschema's answer."""

from __future__ import annotations

import copy
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from report_pages import results

from aici_cli.core.errors import ReportError
from aici_cli.formats import schemas
from aici_cli.formats.schemas import load_schema, schema_valid
from aici_cli.report.summarize import summarize_results

REFERENCE = Draft202012Validator(load_schema("result-line"))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def test_jsonschema_decides_where_the_two_differ() -> None:
    """Python's `$` matches before a final newline and Rust's does not: jsonschema-rs says
    no, jsonschema yes, and so does the check; a NaN (no JSON number in Rust) too."""
    line = results()[0]
    line["input_sha256"] += "\n"
    fast = schemas._fast_check("result-line")
    if fast is not None:
        assert fast(line) is False
    assert schema_valid("result-line", line) is REFERENCE.is_valid(line) is True
    nan = results()[0]
    nan["stats"]["total_ms"] = float("nan")
    assert schema_valid("result-line", nan) is REFERENCE.is_valid(nan) is True
    for bad in ({**results()[0], "index": True}, {**results()[0], "text": 3}):
        assert schema_valid("result-line", bad) is False


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_the_check_agrees_with_jsonschema(data: st.DataObject) -> None:
    """Lines valid by construction, and the same with one field replaced by any value."""
    line = copy.deepcopy(data.draw(st.sampled_from(results())))
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(line) + ["extra"]))
        line[key] = data.draw(JSON)
    assert schema_valid("result-line", line) is REFERENCE.is_valid(line)


def test_without_jsonschema_rs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where jsonschema-rs has no wheel, jsonschema alone answers, the same."""
    monkeypatch.setitem(sys.modules, "jsonschema_rs", None)  # import now fails
    schemas._fast_check.cache_clear()
    try:
        assert schemas._fast_check("result-line") is None
        assert schema_valid("result-line", results()[0]) is True
        lines = [json.dumps(r) + "\n" for r in results()]
        assert summarize_results(lines)["lines"] == 9
        with pytest.raises(ReportError, match=r"line 2: not a result line: index: True is "
                                              r"not of type 'integer'"):
            summarize_results([lines[0], json.dumps({**results()[0], "index": True})])
    finally:
        schemas._fast_check.cache_clear()


def test_an_invalid_line_is_named_as_before() -> None:
    """The message of the most relevant error, from jsonschema (best_match)."""
    lines = [json.dumps(r) + "\n" for r in results()]
    bad = {**results()[1], "stats": {**results()[1]["stats"], "total_ms": -1}}
    with pytest.raises(ReportError, match=r"^line 3: not a result line: stats/total_ms: -1 "
                                          r"is less than the minimum of 0$"):
        summarize_results([lines[0], "\n", json.dumps(bad)])


def test_patterns_are_read_as_python_reads_them() -> None:
    """The input line's `prompt` must match `\\S`: Python's `\\s` counts U+001C and
    U+0085 as space, jsonschema-rs's would not. Its copy of the schema spells `\\S` as
    Python's class, so its "valid" is never jsonschema's "invalid"; a pattern it cannot
    spell so leaves the schema to jsonschema alone."""
    reference = Draft202012Validator(load_schema("input-line"))
    fast = schemas._fast_check("input-line")
    for code in range(0x3100):
        line = {"prompt": chr(code)}
        expected = reference.is_valid(line)
        assert schema_valid("input-line", line) is expected, hex(code)
        if fast is not None and fast(line):
            assert expected, hex(code)
    assert schema_valid("input-line", {"prompt": "\x1c"}) is False
    for pattern in ("\\d", "[\\S]", "\\\\S"):
        with pytest.raises(ValueError):
            schemas._as_rust({"properties": {"a": {"pattern": pattern}}})
    assert schemas._as_rust({"const": {"pattern": "\\d"}}) == {"const": {"pattern": "\\d"}}
