"""The sampling options' one declaration (core/sampling.py) and what is made from it: the
input-line schema holds each range as declared, `run` has each option with its default
and range, and a value of each option reaches a `Job` from an input line, an OpenAI batch
request, lm-eval's gen_kwargs and the run's option, and `made_with` records it."""

from __future__ import annotations

import json
from typing import Any

import click
import pytest

from aici_cli.cli.main import main
from aici_cli.core.config import FIELD_OPTIONS, JobDefaults, RunConfig
from aici_cli.core.job import BadLine, Job
from aici_cli.core.sampling import OPTIONS, RUN_OPTIONS, Option, Range, Sampling
from aici_cli.evals.requests import generation_line
from aici_cli.formats.jobs import load_schema, read_jobs
from aici_cli.formats.jobs.defaults import defaults_problem
from aici_cli.formats.openai_batch import COMPLETIONS, to_line
from aici_cli.run.made_with import run_record

# The keywords of a JSON Schema that decide what a value may be (not its description).
_CHECKS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _other(option: Option) -> Any:
    """A valid value of `option` other than its default: a step above it, or below where
    that is past its range."""
    assert option.range is not None
    step = 1 if option.kind is int else 0.5
    value = option.default + step
    if option.range.high is not None and value > option.range.high:
        value = option.default - step
    return option.kind(value)


def _read(line: dict[str, Any], defaults: JobDefaults | None = None) -> Job:
    [job] = read_jobs([json.dumps(line)], defaults or JobDefaults())
    assert isinstance(job, Job), job
    return job


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_input_line_schema_checks_each_option_as_declared(name: str) -> None:
    """schemas/input-line.schema.json is a published file: it must hold each range as the
    declaration gives it (its description is its own)."""
    option = OPTIONS[name]
    declared = load_schema("input-line")["properties"][name]
    if option.range is None:  # a rule of the schema's own (logit_bias: token ids)
        assert declared["type"] == "object"
        return
    assert {k: v for k, v in declared.items() if k in _CHECKS} == option.schema()


def test_run_has_each_option_with_its_default_range_and_variable() -> None:
    params = {p.name: p for p in main.commands["run"].params if isinstance(p, click.Option)}
    for option in RUN_OPTIONS:
        param = params[option.name]
        assert param.opts == [option.flag] and param.default == option.default
        assert param.envvar == "AICI_BATCH_" + option.name.upper()
        assert isinstance(param.type, (click.IntRange, click.FloatRange))
        assert option.range is not None
        assert (param.type.min, param.type.max, param.type.min_open) == (
            option.range.low, option.range.high, option.range.low_open)
        assert FIELD_OPTIONS[option.name] == option.flag
    assert [o.name for o in OPTIONS.values() if not o.run_option] == ["logit_bias"]


@pytest.mark.parametrize("option", RUN_OPTIONS, ids=lambda o: o.name)
def test_each_option_reaches_a_job_by_every_way_in(option: Option) -> None:
    value = _other(option)
    expected = Sampling(**{option.name: value})
    assert _read({"prompt": "p", option.name: value}).sampling == expected
    # The run's option, as the default of a line that does not set it.
    assert _read({"prompt": "p"}, JobDefaults(sampling=expected)).sampling == expected
    # An OpenAI batch request's body field.
    line, request = to_line({"custom_id": "r", "method": "POST", "url": COMPLETIONS,
                             "body": {"prompt": "p", option.request: value}})
    assert _read(line).sampling == expected
    assert (option.name, f"body.{option.request}") in request.fields
    # lm-eval's gen_kwargs (temperature is `do_sample`'s; the seed defaults per request).
    if option.name != "temperature":
        line = generation_line(1, {option.name: value}, 8, None)
        assert getattr(_read(line).sampling, option.name) == value
    # `made_with` records an option that differs from its default, under its field name.
    config = RunConfig(input="-", defaults=JobDefaults(sampling=expected))
    assert run_record(config, "m", None) == {"model": "m", option.name: value}


@pytest.mark.parametrize("option", RUN_OPTIONS, ids=lambda o: o.name)
def test_a_value_out_of_range_is_the_lines_error_or_the_options(option: Option) -> None:
    """Past its range (or cap), a line's value is that line's error naming the field; the
    run option's, a usage error naming the option."""
    assert option.range is not None
    high = option.range.high if option.range.high is not None else option.range.cap
    bad = option.kind(high + 1) if high is not None else option.kind(option.range.low - 1)
    [item] = read_jobs([json.dumps({"prompt": "p", option.name: bad})], JobDefaults())
    assert isinstance(item, BadLine) and item.type == "invalid_line"
    assert f"field '{option.name}' must be" in item.message
    problem = defaults_problem(JobDefaults(sampling=Sampling(**{option.name: bad})), True)
    assert problem is not None and problem.startswith(f"{option.flag} must be")


def test_a_range_has_a_high_end_or_a_cap() -> None:
    with pytest.raises(ValueError, match="not both"):
        Range(0.0, 1.0, cap=2.0)
