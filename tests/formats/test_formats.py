"""The published JSON Schemas are the contract with users and downstream tools, so they
are tested directly: each must be a valid schema and must accept/reject what the docs say."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from paths import ROOT

from aici_cli.core.job import BadLine, error_result
from aici_cli.core.line_stats import ZERO_STATS
from aici_cli.formats import schemas as formats
from aici_cli.formats.schemas import load_schema

SCHEMA_NAMES = ["input-line", "result-line", "stats"]


def _validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(load_schema(name))


def _is_valid(name: str, instance: Any) -> bool:
    return bool(_validator(name).is_valid(instance))


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_schema_files_are_valid_json_schemas(name: str) -> None:
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_load_schema_reads_the_repo_file(name: str) -> None:
    on_disk = json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text("utf-8"))
    assert load_schema(name) == on_disk
    assert load_schema(f"{name}.schema.json") is load_schema(f"{name}.schema.json")


def test_load_schema_falls_back_to_package_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An installed wheel has no repo-root schemas/ dir; the copy in the package is used.
    package = tmp_path / "aici_cli"
    (package / "schemas").mkdir(parents=True)
    (package / "schemas" / "stats.schema.json").write_text('{"title": "packaged"}', "utf-8")
    monkeypatch.setattr(formats, "_SCHEMA_DIR", tmp_path / "no-such-dir")
    monkeypatch.setattr(
        importlib.resources, "files", lambda anchor: package if anchor == "aici_cli" else None
    )
    load_schema.cache_clear()
    try:
        assert load_schema("stats") == {"title": "packaged"}
    finally:
        load_schema.cache_clear()


GOOD_INPUT_LINES: list[dict[str, Any]] = [
    {"prompt": "hi"},
    {"id": "a", "prompt": "hi", "max_tokens": 1, "temperature": 0, "top_p": 1, "seed": 0},
    {"messages": [{"role": "user", "content": "hi"}], "choices": ["yes", "no"]},
    {"prompt": "x", "json_schema": {"type": "object"}, "stop": ["\n"] * 16},
    {"prompt": "x", "regex": "[0-9]+", "max_tokens": 1_000_000, "temperature": 10},
    {"prompt": "x", "seed": 2**63 - 1, "top_p": 0.01},
    {"prompt": "x", "controller_arg": "text"},
    {"prompt": "x", "controller_arg": {"any": ["thing"]}},
    {"messages": [{"role": "assistant", "content": ""}]},
]

BAD_INPUT_LINES: list[tuple[str, Any]] = [
    ("not an object", ["prompt"]),
    ("unknown field", {"prompt": "x", "promt": "x"}),
    ("neither prompt nor messages", {"id": "a"}),
    ("both prompt and messages", {"prompt": "x", "messages": [{"role": "u", "content": "c"}]}),
    ("empty prompt", {"prompt": ""}),
    ("whitespace prompt", {"prompt": " \t\n"}),
    ("prompt not a string", {"prompt": 3}),
    ("id neither a string nor an integer", {"id": 3.5, "prompt": "x"}),
    ("id a boolean", {"id": True, "prompt": "x"}),
    ("empty messages", {"messages": []}),
    ("message without content", {"messages": [{"role": "user"}]}),
    ("message content not string", {"messages": [{"role": "user", "content": 1}]}),
    ("message extra key", {"messages": [{"role": "user", "content": "c", "x": 1}]}),
    ("json_schema not object", {"prompt": "x", "json_schema": "object"}),
    ("regex not string", {"prompt": "x", "regex": 1}),
    ("empty choices", {"prompt": "x", "choices": []}),
    ("choice not string", {"prompt": "x", "choices": [1]}),
    ("two constraints", {"prompt": "x", "regex": "a", "choices": ["a"]}),
    ("three constraints", {"prompt": "x", "regex": "a", "choices": ["a"], "json_schema": {}}),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}),
    ("max_tokens too big", {"prompt": "x", "max_tokens": 1_000_001}),
    ("max_tokens float", {"prompt": "x", "max_tokens": 1.5}),
    ("max_tokens bool", {"prompt": "x", "max_tokens": True}),
    ("negative temperature", {"prompt": "x", "temperature": -0.1}),
    ("temperature too big", {"prompt": "x", "temperature": 10.5}),
    ("top_p zero", {"prompt": "x", "top_p": 0}),
    ("top_p above one", {"prompt": "x", "top_p": 1.01}),
    ("negative seed", {"prompt": "x", "seed": -1}),
    ("seed too big", {"prompt": "x", "seed": 2**63}),
    ("empty stop string", {"prompt": "x", "stop": [""]}),
    ("too many stops", {"prompt": "x", "stop": ["a"] * 17}),
    ("stop not a list", {"prompt": "x", "stop": "a"}),
    ("controller_arg number", {"prompt": "x", "controller_arg": 1}),
]


@pytest.mark.parametrize("line", GOOD_INPUT_LINES)
def test_good_input_lines_validate(line: dict[str, Any]) -> None:
    errors = [e.message for e in _validator("input-line").iter_errors(line)]
    assert errors == []


@pytest.mark.parametrize(("case", "line"), BAD_INPUT_LINES, ids=[c for c, _ in BAD_INPUT_LINES])
def test_bad_input_lines_fail(case: str, line: Any) -> None:
    assert not _is_valid("input-line", line), case


def _stats(**overrides: Any) -> dict[str, Any]:
    return {**ZERO_STATS, **overrides}


def _result(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "1",
        "index": 1,
        "text": '{"a":1}',
        "finish_reason": "stop",
        "stats": _stats(
            prompt_tokens=5,
            output_tokens=7,
            forward_passes=4,
            ff_tokens=3,
            ttft_ms=1.5,
            total_ms=9.0,
        ),
    }
    return {**base, **overrides}


def test_full_result_line_validates() -> None:
    line = _result(
        json={"a": 1},
        valid=True,
        steps=[
            {
                "step": 0,
                "kind": "prefill",
                "sampled": 1,
                "forced": 4,
                "forward_ms": 1.0,
                "mask_ms": 0.1,
                "controller_ms": 0.0,
                "sample_ms": 0.2,
            },
            {
                "step": 1,
                "kind": "decode",
                "sampled": 0,
                "forced": 0,
                "forward_ms": 1.0,
                "mask_ms": 0.0,
                "controller_ms": 0.3,
                "sample_ms": 0.0,
            },
        ],
        logs="controller said hi\n",
        outputs={"answer": 1},
        warnings=["schema feature ignored"],
    )
    assert _is_valid("result-line", line)


def test_minimal_result_lines_validate() -> None:
    assert _is_valid("result-line", _result())
    assert _is_valid("result-line", _result(finish_reason="length", json=None, valid=False))


@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("error without error object", _result(finish_reason="error")),
        ("unknown finish_reason", _result(finish_reason="eos")),
        ("index zero", _result(index=0)),
        ("unknown field", _result(extra=1)),
        ("missing stats", {k: v for k, v in _result().items() if k != "stats"}),
        ("missing stats field", _result(stats={k: 0 for k in list(ZERO_STATS)[1:]})),
        ("negative tokens", _result(stats=_stats(output_tokens=-1))),
        ("negative time", _result(stats=_stats(total_ms=-0.5))),
        ("float token count", _result(stats=_stats(prompt_tokens=1.5))),
        ("valid not bool", _result(valid="yes")),
        (
            "bad step kind",
            _result(
                steps=[
                    {
                        "step": 0,
                        "kind": "magic",
                        "sampled": 1,
                        "forced": 0,
                        "forward_ms": 0,
                        "mask_ms": 0,
                        "controller_ms": 0,
                        "sample_ms": 0,
                    }
                ]
            ),
        ),
        ("warnings not strings", _result(warnings=[1])),
        ("error missing message", _result(finish_reason="error", error={"type": "x"})),
    ],
)
def test_bad_result_lines_fail(case: str, line: dict[str, Any]) -> None:
    assert not _is_valid("result-line", line), case


def test_error_result_validates_against_result_schema() -> None:
    err = BadLine(index=3, id="q7", type="invalid_json", message="line 3: invalid JSON: x")
    result = error_result(err)
    assert _is_valid("result-line", result)
    assert result == {
        "id": "q7",
        "index": 3,
        "text": "",
        "finish_reason": "error",
        "error": {"type": "invalid_json", "message": "line 3: invalid JSON: x"},
        "stats": ZERO_STATS,
    }


def test_error_result_stats_are_a_copy() -> None:
    err = BadLine(index=1, id="1", type="t", message="line 1: m")
    error_result(err)["stats"]["prompt_tokens"] = 99
    assert ZERO_STATS["prompt_tokens"] == 0


def _dist() -> dict[str, float]:
    return {"p50": 1.0, "p99": 2.0, "mean": 1.2}


def _summary(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "lines": 10,
        "errors": 1,
        "prompt_tokens": 100,
        "output_tokens": 200,
        "ff_tokens": 20,
        "forward_passes": 180,
        "row_forward_passes": 170,
        "wall_s": 2.5,
        "tokens_per_s": 80.0,
        "forward_passes_per_token": 0.9,
        "schema_lines": 4,
        "valid": 4,
        "steps": {
            k: _dist()
            for k in (
                "forward_ms",
                "mask_ms",
                "controller_ms",
                "sample_ms",
                "overhead_ms",
                "step_ms",
            )
        },
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "device": "cpu",
        "dtype": "float32",
        "batch_size": 8,
    }
    return {**base, **overrides}


def test_stats_summary_validates() -> None:
    assert _is_valid("stats", _summary())
    assert _is_valid("stats", _summary(forward_passes_per_token=None, output_tokens=0))


@pytest.mark.parametrize(
    ("case", "summary"),
    [
        ("missing model", {k: v for k, v in _summary().items() if k != "model"}),
        ("lines not integer", _summary(lines=1.5)),
        ("per-token ratio string", _summary(forward_passes_per_token="n/a")),
        ("missing step series", _summary(steps={"forward_ms": _dist()})),
        (
            "step series missing p99",
            _summary(steps={**_summary()["steps"], "mask_ms": {"p50": 1.0, "mean": 1.0}}),
        ),
        ("unknown field", _summary(gpu="h200")),
        ("batch size zero", _summary(batch_size=0)),
    ],
)
def test_bad_stats_summaries_fail(case: str, summary: dict[str, Any]) -> None:
    assert not _is_valid("stats", summary), case
