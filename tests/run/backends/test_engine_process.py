"""The engine in a supervised child process (`--engine-process child`, backends/supervised.py):
a death (a signal, the OOM killer, `kill -9`) costs only the lines in flight, which run
again in a new process with the same results under `--deterministic`; a line that kills
the engine alone ends as `engine_crash`; every line gets exactly one result; a death while
the model loads is one clear line. Deaths are injected with the engine's test-only
variables (backends/child_faults.py) or a real `kill -9` from outside."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.cli.main import main
from aici_cli.core.config import EngineConfig, RunConfig
from aici_cli.formats.jobs import load_schema
from aici_cli.models.progress import LoadProgress
from aici_cli.run.backends.child_faults import (
    CRASH_AT_LOAD_ENV,
    CRASH_AT_STEP_ENV,
    CRASH_ON_ID_ENV,
    CRASH_SIGNAL_ENV,
)
from aici_cli.run.backends.progress_relay import ProgressReplay, RelayProgress
from aici_cli.run.batch import RunOutcome, run_batch

RESULT_SCHEMA = load_schema("result-line")
DEATH = "warning: the engine process died"
N_LINES = 8


def write_input(path: Path, n: int, max_tokens: Callable[[int], int]) -> Path:
    path.write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": f"Line {i}: the quick brown fox, {i * 7}",
                    "max_tokens": max_tokens(i)}) + "\n" for i in range(n)))
    return path


def results_by_index(out: Path) -> dict[int, dict[str, Any]]:
    """Every result of `out` by its line number; fails on a line written twice."""
    results: dict[int, dict[str, Any]] = {}
    for line in out.read_text().splitlines():
        result = json.loads(line)
        jsonschema.validate(result, RESULT_SCHEMA)
        assert result["index"] not in results, f"line {result['index']} written twice"
        results[result["index"]] = result
    return results


def outcome_of(result: dict[str, Any]) -> tuple[Any, ...]:
    return (result["text"], result["finish_reason"], result["stats"]["output_tokens"])


def run(model: Path, src: Path, out: Path, engine_process: str = "child",
        batch_size: int = 4, env: dict[str, str] | None = None) -> tuple[RunOutcome, str]:
    """A deterministic greedy fp32 run of `src` through `run_batch`; its outcome and
    stderr. `env` (fault injection) reaches the engine process through the environment."""
    config = RunConfig(input=str(src), output=str(out), model=str(model), device="cpu",
                       dtype="float32", engine_process=engine_process,
                       engine=EngineConfig(batch_size=batch_size, deterministic=True,
                                           check_invariance=False, draft_tokens=0))
    stderr = io.StringIO()
    with mock.patch.dict(os.environ, env or {}):
        outcome = run_batch(config, stderr=stderr)
    return outcome, stderr.getvalue()


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_input(tmp_path_factory.mktemp("input") / "in.jsonl", N_LINES,
                       lambda i: 4 + i % 5)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, src: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[int, dict[str, Any]]:
    """The lines run in this process, no death."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    outcome, _ = run(tiny_model_dir, src, out, engine_process="inline")
    assert outcome.exit_code == 0
    return results_by_index(out)


# Each example starts two engine processes (~2 s each on 2 cores).
@pytest.mark.subprocess
@settings(max_examples=5, deadline=None)
@given(kill_step=st.integers(1, 8), batch_size=st.integers(1, 4))
def test_a_death_at_any_step_reruns_the_lines_in_flight_with_the_same_results(
        tiny_model_dir: Path, src: Path, reference: dict[int, dict[str, Any]],
        kill_step: int, batch_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        outcome, stderr = run(tiny_model_dir, src, out, batch_size=batch_size,
                              env={CRASH_AT_STEP_ENV: str(kill_step)})
        results = results_by_index(out)

    # At most 8 lines of at least 4 tokens, 4 rows: more than 8 steps, so the kill lands.
    assert outcome.engine_deaths == 1, stderr
    assert stderr.count(DEATH) == 1 and "(SIGKILL)" in stderr
    assert outcome.exit_code == 1  # a death, though every line has its result
    assert set(results) == set(reference)
    for index, result in results.items():
        assert outcome_of(result) == outcome_of(reference[index]), index


@pytest.mark.subprocess
def test_a_line_that_kills_the_engine_ends_as_engine_crash_and_the_others_run(
        tiny_model_dir: Path, src: Path, reference: dict[int, dict[str, Any]],
        tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    outcome, stderr = run(tiny_model_dir, src, out, batch_size=2,
                          env={CRASH_ON_ID_ENV: "p3", CRASH_SIGNAL_ENV: "SIGSEGV"})
    results = results_by_index(out)

    assert set(results) == set(reference)
    crashed = results[4]  # p3: line 4
    assert crashed["finish_reason"] == "error"
    assert crashed["error"]["type"] == "engine_crash"
    assert "SIGSEGV" in crashed["error"]["message"]
    for index, result in results.items():
        if index != 4:
            assert outcome_of(result) == outcome_of(reference[index]), index
    # In flight at the first death, again at the second (then alone), alone at the third.
    assert outcome.engine_deaths == 3
    warnings = [line for line in stderr.splitlines() if DEATH in line]
    assert len(warnings) == 3, stderr
    assert all("(SIGSEGV)" in w and "dtype float32" in w for w in warnings)
    assert "line 4 killed it again, alone" in warnings[-1]
    assert outcome.exit_code == 1
    assert outcome.summary["error_types"] == {"engine_crash": 1}


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def kill_the_engine_mid_run(args: list[str], out: Path,
                            timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """`aici-batch run ARGS` with its default engine process, whose process is killed
    (SIGKILL, from outside) once the first result is in `out`."""
    env = {k: v for k, v in os.environ.items() if k != "AICI_BATCH_ENGINE_PROCESS"}
    exe = Path(sys.executable).with_name("aici-batch")
    proc = subprocess.Popen([str(exe), "run", *args, "-o", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while _count_lines(out) == 0:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (engine,) = _children(proc.pid)
    os.kill(engine, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


@pytest.mark.subprocess
def test_kill_9_of_the_engine_from_outside_loses_no_line(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    n = 40
    src = write_input(tmp_path / "in.jsonl", n, lambda i: 24)
    out = tmp_path / "out.jsonl"
    done = kill_the_engine_mid_run([str(src), "--model", str(tiny_model_dir), "--device",
                                    "cpu", "--dtype", "float32", "--batch-size", "4"], out)

    assert done.returncode == 1, done.stderr
    assert done.stderr.count(DEATH) == 1 and "(SIGKILL)" in done.stderr, done.stderr
    results = results_by_index(out)
    assert sorted(results) == list(range(1, n + 1))
    assert all(r["finish_reason"] == "length" for r in results.values())


@pytest.mark.subprocess
def test_a_death_while_the_model_loads_is_one_clear_line(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    src = write_input(tmp_path / "in.jsonl", 2, lambda i: 2)
    with mock.patch.dict(os.environ, {CRASH_AT_LOAD_ENV: "1"}):
        res = CliRunner().invoke(main, ["run", str(src), "--model", str(tiny_model_dir),
                                        "--engine-process", "child", "-q"])

    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    (line,) = res.stderr.splitlines()
    assert line.startswith("Error: the engine process died while loading the model "
                           "(SIGKILL): ")
    assert "--dtype float32" in line and "aici-batch doctor" in line


class Recorded(LoadProgress):
    def __init__(self) -> None:
        self.said: list[str] = []

    def note(self, message: str) -> None:
        self.said.append(message)

    def steps(self, items: Any, total: int, description: str) -> Any:
        self.said.append(f"begin {description} /{total}")
        for k, item in enumerate(items):
            yield item
            self.said.append(f"step {k + 1}")


def test_load_progress_is_replayed_as_it_was_reported() -> None:
    shown = Recorded()
    replay = ProgressReplay(shown)
    relay = RelayProgress(replay.show)

    relay.note("converting model.gguf (once)")
    assert list(relay.steps(["a", "b", "c"], 3, "tensors")) == ["a", "b", "c"]

    assert shown.said == ["converting model.gguf (once)", "begin tensors /3", "step 1",
                          "step 2", "step 3"]


@pytest.mark.real_model
def test_kill_9_of_the_default_models_engine_loses_no_line(tmp_path: Path) -> None:
    n = 8
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": f"Count from {i} to {i + 20}, one number a line."}],
        "max_tokens": 6 + 4 * i}) + "\n" for i in range(n)))
    out = tmp_path / "out.jsonl"
    done = kill_the_engine_mid_run([str(src)], out, timeout=600)

    assert done.returncode == 1, done.stderr
    assert done.stderr.count(DEATH) == 1 and "(SIGKILL)" in done.stderr, done.stderr
    results = results_by_index(out)
    assert sorted(results) == list(range(1, n + 1))
    assert all(r["finish_reason"] != "error" for r in results.values())
