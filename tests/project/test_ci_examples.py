"""The CI examples (examples/ci): their eval and gate commands, read out of the workflow
files and run as written in bash: the eval, the gate without previous results, the gate
again once the results are kept as the next run's baseline (the same results: nothing
changed), and the gate with a threshold the eval cannot reach. The default model is
swapped for the tiny one through AICI_BATCH_MODEL, which `aici-batch run` reads as
--model. (The eval runs once per file: starting a run is most of its cost here.)

And the cache folder both jobs keep: a first GitHub job on a fresh runner (its key, eval
and prepare steps) leaves a folder that, restored into a fresh one as `actions/cache`
does, starts the next job's runs compiled under the same key; one another CPU made is
rebuilt, never used. The tiny model at AICI_BATCH_BATCH_SIZE=2 (which `run` and `prepare`
read) keeps the builds to three."""

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


def bash(script: str, cwd: Path, env: dict[str, str],
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # GitHub runs a step with `bash -e {0}`; GitLab stops at the first line that fails.
    return subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def job_env(model: Path, tmp_path: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "AICI_BATCH_MODEL": str(model), "AICI_BATCH_QUIET": "1",
            "EVAL_INPUT": str(EVAL), "MIN_ACCURACY": "0",
            "GITHUB_STEP_SUMMARY": str(tmp_path / "step_summary.md"),
            "GITHUB_OUTPUT": str(tmp_path / "github_output")}


@pytest.fixture
def env(tiny_model_dir: Path, tmp_path: Path) -> dict[str, str]:
    return job_env(tiny_model_dir, tmp_path)


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
def test_the_gitlab_ci_script(env: dict[str, str], tmp_path: Path, kept: Path) -> None:
    script = gitlab_script()
    assert script[0].startswith("aici-batch run ")
    assert script[1] == "aici-batch doctor --cache-key && aici-batch prepare"
    job = yaml.safe_load((CI / "gitlab-ci.yml").read_text())["eval"]
    assert job["cache"]["paths"] == [".aici-batch-cache/"]
    assert job["variables"]["AICI_BATCH_CACHE"] == "$CI_PROJECT_DIR/.aici-batch-cache"
    work = tmp_path / "gl"
    work.mkdir()
    # GitLab's `cache:` restored a folder a job like the GitHub one left: prepare finds
    # every compiled step built.
    env = {**env, "AICI_BATCH_CACHE": str(restored(kept, tmp_path / "gl-cache")),
           "AICI_BATCH_BATCH_SIZE": "2"}
    done = bash("\n".join(script), work, env)
    assert done.returncode == 0, done.stderr
    assert "start with the compiled one-token step (1 and 2 rows" in done.stdout
    summary = (work / "summary.md").read_text()
    assert "| lines |" in summary and "Against the baseline" not in summary
    # As the next pipeline, which downloaded these results (the gate's lines only).
    (work / "previous").mkdir()
    shutil.copy(work / "results.jsonl", work / "previous" / "results.jsonl")
    done = bash("\n".join(script[2:]), work, {**env, "MIN_ACCURACY": "1"})
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


# ------------------------------------------------------------------- the kept cache
GENERATING = "".join(json.dumps({"prompt": p, "max_tokens": 12, "ignore_eos": True}) + "\n"
                     for p in ("the quick brown fox", "hello world, hello again and", "a b c"))


def restored(saved: Path, where: Path) -> Path:
    """`saved` as a CI cache restores it: copied into a fresh folder elsewhere."""
    shutil.copytree(saved, where, symlinks=True)
    return where


def generate(env: dict[str, str], work: Path) -> tuple[dict[str, Any], str]:
    """A run of three generating lines (the eval scores: it takes no one-token step) at
    the job's options and cache: its summary and stderr."""
    (work / "gen.jsonl").write_text(GENERATING)
    done = subprocess.run(["aici-batch", "run", "gen.jsonl", "-o", "gen-out.jsonl",
                           "--stats-out", "gen-stats.json", "--draft-tokens", "0"],
                          cwd=work, env={**env, "AICI_BATCH_QUIET": "0"}, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads((work / "gen-stats.json").read_text()), done.stderr


def key_of(env: dict[str, str], work: Path) -> str:
    """The key the `cache-key` step gives `actions/cache`."""
    Path(env["GITHUB_OUTPUT"]).write_text("")
    done = bash(github_steps()["cache-key"], work, env)
    assert done.returncode == 0, done.stderr
    line = Path(env["GITHUB_OUTPUT"]).read_text().strip()
    assert line.startswith("key=aici-batch-")
    return line.removeprefix("key=")


@pytest.fixture(scope="module")
def kept(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache folder a first GitHub job saves: its key, eval and prepare steps run as
    written on a fresh runner (an empty folder)."""
    root = tmp_path_factory.mktemp("kept")
    work = root / "work"
    work.mkdir()
    env = {**job_env(tiny_model_dir, root), "AICI_BATCH_CACHE": str(root / "cache"),
           "AICI_BATCH_BATCH_SIZE": "2"}
    (root / "key").write_text(key_of(env, work))
    steps = github_steps()
    for name in ("eval", "prepare"):
        done = bash(steps[name], work, env, timeout=900)
        assert done.returncode == 0, (name, done.stderr)
    assert len(list((root / "cache" / "compiled-steps").glob("*.pt2"))) == 3
    return root / "cache"


def test_the_github_job_keeps_the_cache_folder_under_its_key() -> None:
    workflow = yaml.safe_load((CI / "github-actions.yml").read_text())
    job = workflow["jobs"]["eval"]
    assert job["env"]["AICI_BATCH_CACHE"] == "${{ github.workspace }}/.aici-batch-cache"
    steps = job["steps"]
    uses = {s.get("uses", "").split("@")[0]: s for s in steps if "uses" in s
            and s["uses"].startswith("actions/cache/") and "AICI" in s["with"]["path"]}
    key = "${{ steps.cache-key.outputs.key }}"
    assert uses["actions/cache/restore"]["with"] == {"path": "${{ env.AICI_BATCH_CACHE }}",
                                                     "key": key}
    assert uses["actions/cache/save"]["with"]["key"] == key
    ids = [s.get("id") for s in steps]
    # The key before the restore, prepare after the eval and before the save.
    assert ids.index("cache-key") < ids.index("restore-cache") < ids.index("eval") \
        < ids.index("prepare") < steps.index(uses["actions/cache/save"])


@pytest.mark.subprocess
def test_a_restored_cache_starts_the_next_job_compiled(
        kept: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    work = tmp_path / "next"
    work.mkdir()
    env = {**job_env(tiny_model_dir, tmp_path), "AICI_BATCH_BATCH_SIZE": "2",
           "AICI_BATCH_CACHE": str(restored(kept, tmp_path / "restored"))}
    assert key_of(env, work) == (kept.parent / "key").read_text()  # a cache hit
    summary, _ = generate(env, work)
    assert summary["compiled_steps"] > 0 and summary["eager_steps"] == {}
    assert summary["first_result_s"] <= summary["total_s"]


@pytest.mark.subprocess
def test_a_cache_another_cpu_made_is_rebuilt_never_used(
        kept: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    from aici_cli.models.cache.machine import MACHINE_FILE
    from aici_cli.models.kernels.cpu_features import cpu_features

    cache = restored(kept, tmp_path / "foreign")
    other = "Linux x86_64 Another CPU 0123456789ab"
    (cache / MACHINE_FILE).write_text(json.dumps({"fingerprint": other}))
    work = tmp_path / "job"
    work.mkdir()
    env = {**job_env(tiny_model_dir, tmp_path), "AICI_BATCH_BATCH_SIZE": "2",
           "AICI_BATCH_CACHE": str(cache)}
    summary, stderr = generate(env, work)
    assert f"was made on another CPU ({other})" in stderr
    assert summary["compiled_steps"] == 0 and sum(summary["eager_steps"].values()) > 0
    assert not (cache / "compiled-steps").exists() or \
        not list((cache / "compiled-steps").glob("*.pt2"))
    assert json.loads((cache / MACHINE_FILE).read_text())["fingerprint"] == \
        cpu_features().fingerprint
    # Rebuilt by the job's prepare step; then its runs start compiled.
    done = bash(github_steps()["prepare"], work, env, timeout=900)
    assert done.returncode == 0, done.stderr
    assert len(list((cache / "compiled-steps").glob("*.pt2"))) == 3
    summary, stderr = generate(env, work)
    assert "another CPU" not in stderr
    assert summary["compiled_steps"] > 0 and summary["eager_steps"] == {}
