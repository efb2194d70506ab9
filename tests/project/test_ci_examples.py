"""The CI examples (examples/ci): their eval and gate commands, read out of the workflow
files and run as written in bash: the eval, the gate without previous results, the gate
again once the results are kept as the next run's baseline (the same results: nothing
changed), and the gate with a threshold the eval cannot reach. The default model is
swapped for the tiny one through AICI_BATCH_MODEL, which `aici-batch run` reads as
--model. (The eval runs once per file: starting a run is most of its cost here.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import ROOT

CI = ROOT / "examples" / "ci"
EVAL = ROOT / "examples" / "eval" / "eval.jsonl"


def github_steps() -> dict[str, str]:
    """The `run` text of each step with an id."""
    workflow = yaml.safe_load((CI / "github-actions.yml").read_text())
    steps = workflow["jobs"]["eval"]["steps"]
    return {s["id"]: s["run"] for s in steps if "id" in s and "run" in s}


def gitlab_script() -> list[str]:
    job = yaml.safe_load((CI / "gitlab-ci.yml").read_text())["eval"]
    return list(job["script"])


def bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # GitHub runs a step with `bash -e {0}`; GitLab stops at the first line that fails.
    return subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


@pytest.fixture
def env(tiny_model_dir: Path, tmp_path: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "AICI_BATCH_MODEL": str(tiny_model_dir), "AICI_BATCH_QUIET": "1",
            "EVAL_INPUT": str(EVAL), "MIN_ACCURACY": "0",
            "GITHUB_STEP_SUMMARY": str(tmp_path / "step_summary.md")}


def junit_cases(path: Path) -> int:
    from junitparser import JUnitXml

    return sum(suite.tests for suite in JUnitXml.fromfile(str(path)))


def page_lines(path: Path) -> int:
    """The rows of a `report --html` page, each paired with its input line's prompt."""
    from aici_cli.report.page.payload import decode

    data = decode(path.read_text(encoding="utf-8"))
    assert all("prompt" in d.get("input", {}) for d in data["details"])
    return len(data["rows"])


@pytest.mark.subprocess
def test_the_github_actions_steps(env: dict[str, str], tmp_path: Path) -> None:
    steps = github_steps()
    assert set(steps) >= {"eval", "gate", "keep"}
    work = tmp_path / "gh"
    work.mkdir()
    for name in ("eval", "gate", "keep"):
        done = bash(steps[name], work, env)
        assert done.returncode == 0, (name, done.stderr)
    lines = len(EVAL.read_text().splitlines())
    assert junit_cases(work / "junit.xml") == lines
    assert page_lines(work / "report.html") == lines
    first = Path(env["GITHUB_STEP_SUMMARY"]).read_text()
    assert "### Gates" in first and "Against the baseline" not in first
    # The next gate finds the kept results and compares with them.
    done = bash(steps["gate"], work, env)
    assert done.returncode == 0, done.stderr
    second = Path(env["GITHUB_STEP_SUMMARY"]).read_text()[len(first):]
    assert f"- {lines} lines matched previous/results.jsonl by id and input digest" in second
    assert "0 answers changed" in second
    # A threshold the eval misses fails the step, with the reason on stderr.
    done = bash(steps["gate"], work, {**env, "MIN_ACCURACY": "1"})
    assert done.returncode == 3
    assert "aici-batch report: gate failed: accuracy" in done.stderr


@pytest.mark.subprocess
def test_the_gitlab_ci_script(env: dict[str, str], tmp_path: Path) -> None:
    script = gitlab_script()
    assert script[0].startswith("aici-batch run ")
    work = tmp_path / "gl"
    work.mkdir()
    done = bash("\n".join(script), work, env)
    assert done.returncode == 0, done.stderr
    summary = (work / "summary.md").read_text()
    assert "| lines |" in summary and "Against the baseline" not in summary
    # As the next pipeline, which downloaded these results (the gate's lines only).
    (work / "previous").mkdir()
    shutil.copy(work / "results.jsonl", work / "previous" / "results.jsonl")
    done = bash("\n".join(script[1:]), work, {**env, "MIN_ACCURACY": "1"})
    assert done.returncode == 3
    assert "aici-batch report: gate failed: accuracy" in done.stderr
    assert "Against the baseline `previous/results.jsonl`" in (work / "summary.md").read_text()
    assert junit_cases(work / "junit.xml") == len(EVAL.read_text().splitlines())
    assert page_lines(work / "report.html") == len(EVAL.read_text().splitlines())
    report: dict[str, Any] = json.loads(subprocess.run(
        ["aici-batch", "report", "results.jsonl", "--json", "--baseline",
         "previous/results.jsonl"], cwd=work, env=env, text=True, capture_output=True,
        timeout=120).stdout)
    assert report["baseline"]["matched"] == report["lines"]
