"""Finishing JSON values before the token limit cuts them off, and on loops."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.cli.main import main
from aici_cli.control.grammar.closing import Closer, closing_order, json_state
from aici_cli.control.grammar.compiler import GrammarCompiler
from aici_cli.control.grammar.loops import find_loop
from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.formats.jobs import load_schema
from aici_cli.models import LoadedModel

STRING = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
NESTED = {"type": "object",
          "properties": {"n": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "inner": {"type": "object", "properties": {"x": {"type": "string"}},
                                   "required": ["x"]}},
          "required": ["n", "tags", "inner"]}
ROWS = {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}},
                                   "required": ["a"]}}


def jobs(max_tokens: int) -> list[Job]:
    return [Job(index=i + 1, id=str(i), prompt="Data:", messages=None, max_tokens=max_tokens,
                constraint=Constraint("json_schema", s))
            for i, s in enumerate([STRING, NESTED, ROWS])]


def run(lm: LoadedModel, lines: list[Job], **config: Any) -> dict[int, dict[str, Any]]:
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(**config)).run(lines, results.append)
    return {r["index"]: r for r in results}


def test_json_state_and_what_closes_it() -> None:
    assert json_state('{"a": "x\\"y') == (True, ["{"], ":")
    assert json_state('{"a": [1, {"b": 2}') == (False, ["{", "["], "v")
    assert closing_order('{"a": "xy')[0] == '"'
    assert closing_order('{"a": [1')[0] == "]"
    assert closing_order('{"a": 1')[0] == "}"
    assert closing_order('{"a": ')[0] == "0"


@pytest.mark.parametrize("max_tokens", [28, 48])  # room for the smallest values
def test_values_the_limit_would_cut_are_finished_and_valid(lm: LoadedModel,
                                                           max_tokens: int) -> None:
    lines = jobs(max_tokens)
    plain = run(lm, lines, close_at_limit=False, loop_guard=False)
    closed = run(lm, lines, loop_guard=False)
    schemas = [STRING, NESTED, ROWS]
    assert any(r["finish_reason"] == "length" for r in plain.values())
    for j, schema in zip(lines, schemas):
        before, after = plain[j.index], closed[j.index]
        if before["finish_reason"] == "length":
            assert after["finish_reason"] == "stop" and after["stats"]["closed_early"] is True
            assert after["stats"]["close_reason"] == "limit"
            assert after["valid"] is True
            jsonschema.validate(json.loads(after["text"]), schema)
            assert after["stats"]["output_tokens"] <= max_tokens
        else:  # it finished on its own, well within the limit: nothing changes
            assert after["text"] == before["text"] and "closed_early" not in after["stats"]


def _shared(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _first_loop(lm: LoadedModel, ids: list[int]) -> int | None:
    """The token count at which `ids`' text first loops (None: never)."""
    text = lm.tokenizer.decode
    return next((n for n in range(1, len(ids) + 1) if find_loop(text(ids[:n]))), None)


def test_the_loop_guard_changes_only_looping_outputs(lm: LoadedModel) -> None:
    lines = [dataclasses.replace(j, logprobs=0) for j in jobs(60)]  # the token ids, too
    plain = run(lm, lines, close_at_limit=False, loop_guard=False)
    guarded = run(lm, lines, close_at_limit=False)
    assert any(r["stats"].get("loops_undone") for r in guarded.values())
    for j in lines:
        before, after = plain[j.index], guarded[j.index]
        ids = [e["id"] for e in after["logprobs"]]
        plain_ids = [e["id"] for e in before["logprobs"]]
        fired = _first_loop(lm, plain_ids)
        if fired is None:  # never looped: not touched
            assert after["text"] == before["text"] and after["stats"].keys() == \
                before["stats"].keys()
            continue
        # The first loop was taken back: up to where it began, the unguarded tokens.
        assert after["stats"]["loops_undone"] == 1
        assert 0 < _shared(ids, plain_ids) < fired
        assert find_loop(after["text"]) is None
        if after["stats"].get("closed_early"):  # it looped again: closed, valid
            assert after["valid"] is True and after["finish_reason"] == "stop"
            assert after["stats"]["close_reason"] == "loop"


def test_close_at_limit_through_the_cli(tiny_model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "Data:", "json_schema": NESTED, "max_tokens": 30,
                               "n": 2, "temperature": 1.0}) + "\n")
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                    str(tiny_model_dir), "--dtype", "float32", "-q"])
    assert res.exit_code == 0, res.output
    [result] = [json.loads(x) for x in out.read_text().splitlines()]
    jsonschema.validate(result, load_schema("result-line"))
    assert all(c["valid"] for c in result["choices"])


def test_closing_is_the_default_and_each_switch_turns_it_off(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """By default a line the limit would cut ends closed; `--no-close-at-limit` gives the
    cut-off output back (and `--no-loop-guard` alone keeps closing at the limit)."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": "Data:", "json_schema": s,
                                       "max_tokens": 28}) + "\n"
                           for i, s in enumerate([STRING, NESTED, ROWS])))

    def results(*flags: str) -> dict[str, dict[str, Any]]:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
        res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                        str(tiny_model_dir), "--dtype", "float32", "-q",
                                        *flags])
        assert res.exit_code in (0, 1), res.output
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    stats = tmp_path / "stats.json"
    default, no_guard = results("--stats-out", str(stats)), results("--no-loop-guard")
    # The summary counts the closed lines apart, and compliance with and without them.
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, load_schema("stats"))
    for why in ("limit", "loop"):
        assert summary["closed_early"][why] == sum(
            r["stats"].get("close_reason") == why for r in default.values())
    assert sum(summary["closed_early"].values()) > 0
    assert summary["valid_unclosed"] == sum(
        r["valid"] and "close_reason" not in r["stats"] for r in default.values())
    assert summary["compliance_unclosed"] < summary["compliance"] == 1.0
    off = results("--no-close-at-limit", "--no-loop-guard")
    assert any(r["finish_reason"] == "length" for r in off.values())
    assert not any(r["finish_reason"] == "length" for r in default.values())
    assert not any(r["finish_reason"] == "length" for r in no_guard.values())
    for r in [*default.values(), *no_guard.values()]:
        assert r["valid"] is True
    assert all(r["stats"].get("close_reason") != "loop" for r in no_guard.values())


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(digits=st.integers(1, 12), sep=st.sampled_from(["#", "@", "_", "~"]),
       tail=st.sampled_from(["[a-z]+", "[A-Za-z0-9]+", "x{2}"]))
def test_a_pattern_completes_past_a_digit_run(lm: LoadedModel, digits: int, sep: str,
                                              tail: str) -> None:
    """A string whose pattern needs a character the closing list lacks after a run it
    repeats (`^[0-9]+#[a-z]+`): the completion takes the first other token the grammar
    allows, not the digit forever, and the closed string matches the pattern."""
    pattern = f"^[0-9]+{sep}{tail}$"
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": pattern}},
              "required": ["id"]}
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    matcher = compiler.compile(Constraint("json_schema", schema)).template.deep_copy()
    text = '{"id": "' + "1" * digits
    prefix = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert matcher.consume_tokens(prefix)
    completion = Closer(lm.tokenizer).completion(matcher, text, 24)
    assert completion is not None
    whole = lm.tokenizer.decode(prefix + completion)
    jsonschema.validate(json.loads(whole), schema)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.text("abcxyz-\\+", max_size=12), count=st.integers(2, 16),
       kind=st.sampled_from(["digits", "letters", "min_length"]))
def test_a_string_that_needs_a_run_completes(lm: LoadedModel, junk: str, count: int,
                                             kind: str) -> None:
    """A string that cannot close before a run of one kind (`\\d{10,11}` somewhere in it,
    `[a-z]{n}` at its end, a `minLength`), from whatever it holds so far: the completion
    writes the run and closes, and the value validates."""
    rule = {"digits": {"pattern": f"\\d{{{count},{count + 1}}}"},
            "letters": {"pattern": f"[a-z]{{{count}}}$"},
            "min_length": {"minLength": len(junk) + count}}[kind]
    schema = {"type": "object", "properties": {"v": {"type": "string", **rule}},
              "required": ["v"]}
    compiler = GrammarCompiler(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    matcher = compiler.compile(Constraint("json_schema", schema)).template.deep_copy()
    text = '{"v": "' + junk.replace("\\", "\\\\")
    prefix = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert matcher.consume_tokens(prefix)
    completion = Closer(lm.tokenizer).completion(matcher, text, 40)
    assert completion is not None, (text, schema)
    jsonschema.validate(json.loads(lm.tokenizer.decode(prefix + completion)), schema)


def test_a_loop_no_completion_closes_ends_cut_at_the_loop(lm: LoadedModel,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Where the closer finds no completion from anywhere (no plan either), a looping
    line still ends at the loop, not at max_tokens: its output cut where the loop's text
    begins, `finish_reason: "length"`, `close_reason: "loop_unclosable"`, not valid."""
    lines = [dataclasses.replace(j, logprobs=0) for j in jobs(120)]
    plain = run(lm, lines, close_at_limit=False, loop_guard=False)
    monkeypatch.setattr(Closer, "completion", lambda self, m, text, limit, hints=None: None)
    cut = run(lm, lines)
    assert any(r["stats"].get("close_reason") == "loop_unclosable" for r in cut.values())
    for j in lines:
        before, after = plain[j.index], cut[j.index]
        ids = [e["id"] for e in after["logprobs"]]
        plain_ids = [e["id"] for e in before["logprobs"]]
        if after["stats"].get("close_reason") != "loop_unclosable":
            if not after["stats"].get("loops_undone"):
                assert after["text"] == before["text"]
            continue
        # Undone once, looped again, cut where that loop began: never run to the limit.
        assert after["stats"]["loops_undone"] == 1 and after["stats"]["closed_early"] is True
        assert _shared(ids, plain_ids) < (_first_loop(lm, plain_ids) or 0)
        assert after["finish_reason"] == "length" and after["valid"] is False
        assert after["stats"]["output_tokens"] == len(ids) < j.max_tokens
        assert find_loop(after["text"]) is None
