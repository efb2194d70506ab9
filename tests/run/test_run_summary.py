"""The first minute in the run summary (run/summary.py, `--stats-out`): the time to the
first result, and the one-token steps run compiled and eager by why, the same from an
engine in the run's process and in its own (backends/supervised.py), in the schema and
in the summary table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from aici_cli.core.config import EngineConfig, RunConfig
from aici_cli.engine.forward.decode_steps import NOT_BUILT_YET, NOT_WORTH_BUILDING
from aici_cli.formats.jobs import load_schema
from aici_cli.run.batch import run_batch
from aici_cli.run.ui import one_token_rows

STATS_SCHEMA = load_schema("stats")


def _summary(model: Path, tmp_path: Path, engine_process: str, compile: str,
             lines: int = 4) -> dict[str, Any]:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"line {i}: the quick brown fox",
                                       "max_tokens": 6 + i, "ignore_eos": True}) + "\n"
                           for i in range(lines)))
    config = RunConfig(input=str(src), output=str(tmp_path / f"out-{engine_process}.jsonl"),
                       model=str(model), device="cpu", dtype="float32", quiet=True,
                       engine_process=engine_process,
                       engine=EngineConfig(batch_size=2, draft_tokens=0, compile=compile))
    outcome = run_batch(config)
    assert outcome.exit_code == 0
    jsonschema.validate(outcome.summary, STATS_SCHEMA)
    return outcome.summary


def test_the_summary_has_the_first_result_and_the_eager_steps_by_why(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    summary = _summary(tiny_model_dir, tmp_path, "inline", "off")
    first = summary["first_result_s"]
    assert summary["load_s"] < first <= summary["total_s"]
    eager = summary["eager_steps"]
    assert list(eager) == ["--compile off"] and 0 < eager["--compile off"] \
        < summary["batched_forward_passes"]
    assert "compiled_steps" not in summary
    # `auto` without a packaged step and with no builder (the tests' environment): eager,
    # first while the forecast measures, then because a build would not pay.
    auto = _summary(tiny_model_dir, tmp_path, "inline", "auto")
    assert auto["compiled_steps"] == 0
    assert sum(auto["eager_steps"].values()) == eager["--compile off"]
    assert set(auto["eager_steps"]) <= {NOT_BUILT_YET, NOT_WORTH_BUILDING}


@pytest.mark.subprocess
def test_an_engine_process_reports_the_same_eager_steps(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    inline = _summary(tiny_model_dir, tmp_path, "inline", "off")
    child = _summary(tiny_model_dir, tmp_path, "child", "off")
    assert child["eager_steps"] == inline["eager_steps"]
    assert child["load_s"] < child["first_result_s"] <= child["total_s"]


def test_the_table_says_compiled_and_eager_steps_and_why() -> None:
    assert one_token_rows({}) == []
    assert one_token_rows({"compiled_steps": 120, "eager_steps": {}}) == [
        ("one-token steps compiled / eager", "120 / 0")]
    assert one_token_rows({"compiled_steps": 90, "eager_steps": {
        NOT_BUILT_YET: 30, "build failed": 2}}) == [
        ("one-token steps compiled / eager", "90 / 32 (30 not built yet, 2 build failed)")]
    assert one_token_rows({"eager_steps": {"--compile off": 7}}) == [
        ("one-token steps compiled / eager", "0 / 7 (7 --compile off)")]
