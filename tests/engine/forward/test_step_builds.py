"""`--compile auto` without packaged steps (engine/forward/decode_steps.py,
step_builds.py): the run starts eagerly; a builder process makes the packages, during
the run where the forecast says it pays, else after its last line; the step after a
package appears takes it, with the eager tokens; a builder that fails leaves the run
eager and says why.

One builder builds the tiny model's 2- and 1-row packages (~30-100 s on 2 cores); the
switch-over test reuses them, put in place while its run goes on.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine.engine import Engine
from aici_cli.engine.forward import build_decision, decode_steps, packaged_step, step_builds
from aici_cli.engine.forward.cache import RowCache
from aici_cli.engine.forward.decode_steps import DecodeSteps
from aici_cli.engine.forward.step_builds import BuildSource, StepBuilds
from aici_cli.models.load import LoadedModel, load_model

pytestmark = [pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                 reason="inductor needs a C++ compiler for CPU kernels"),
              pytest.mark.heavy, pytest.mark.subprocess]

PROMPTS = ["the quick brown fox", "hello world, hello again and", "a b c"]


def _run(lm: LoadedModel, mode: str, lengths: list[int]) -> tuple[dict[int, list[int]], Engine]:
    """Greedy tokens per line at batch 2."""
    engine = Engine(lm, EngineConfig(batch_size=2, compile=mode, draft_tokens=0,
                                     initial_capacity=64))
    jobs = [Job(index=i + 1, id=str(i), max_tokens=n, constraint=None,
                prompt=PROMPTS[i % len(PROMPTS)], messages=None, ignore_eos=True, logprobs=0)
            for i, n in enumerate(lengths)]
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    return {r["index"]: [e["id"] for e in r["logprobs"]] for r in results}, engine


def _stop(builds: StepBuilds | None) -> None:
    """A builder a failed test leaves running is ended (its own session)."""
    if builds is not None and builds.process is not None and builds.process.poll() is None:
        os.killpg(builds.process.pid, signal.SIGKILL)
        builds.process.wait()


@pytest.fixture(scope="module")
def built(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache whose packages (2 and 1 rows, a 2-row cache) a real builder made after a
    run that did not pay for one; the run's and the next run's facts checked on the way."""
    cache = tmp_path_factory.mktemp("built-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AICI_BATCH_CACHE", str(cache))
        mp.setenv(step_builds.ENV, "background")
        lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
        lengths = [24, 12, 16]
        eager, first = _run(lm, "auto", lengths)
        decode = first.runner.model_pass.decode
        try:
            # Far too short to pay: eager throughout, the builder started at its end.
            assert decode.compiled is not None and decode.compiled.steps == 0
            assert decode.forecast is not None and not decode.forecast.pays
            assert set(first.eager_steps) == {decode_steps.NOT_BUILT_YET,
                                              decode_steps.NOT_WORTH_BUILDING}
            assert first.eager_steps[decode_steps.NOT_BUILT_YET] == \
                build_decision.MEASURED_PASSES
            assert decode.builds is not None and decode.builds.started
            assert not decode.builds.during_run
            assert decode.builds.wait(timeout=600) == 0
        finally:
            _stop(decode.builds)
        wanted = {packaged_step.package_file(lm.model, rows, 2) for rows in (2, 1)}
        assert set((cache / packaged_step.FOLDER).glob("*.pt2")) == wanted
        assert build_decision.TIMES_FILE in os.listdir(cache / packaged_step.FOLDER)
        # The next run starts compiled, with the same tokens, and starts no builder.
        again, second = _run(lm, "auto", lengths)
        assert again == eager
        assert second.compiled_steps == sum(1 for s in second.step_times
                                            if s.kind == "decode") > 0
        assert second.eager_steps == {}
        assert not second.runner.model_pass.decode.builds.started  # type: ignore[union-attr]
    yield cache


def test_a_package_that_appears_during_the_run_is_taken_the_step_after(
        built: Path, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    monkeypatch.setenv(step_builds.ENV, "background")
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    lengths = [60, 50]
    eager, _ = _run(lm, "off", lengths)
    # The forecast says a build pays; the "builder" publishes the packages a few steps
    # after it starts, as a real one does when its build ends.
    monkeypatch.setattr(build_decision, "forecast", lambda *a: build_decision.Forecast(
        True, 100.0, 1.0, 50.0, 0.1))
    monkeypatch.setattr(step_builds, "RECHECK_S", 1e-9)  # every step
    started: list[list[int]] = []

    def start(self: StepBuilds, rows: list[int], during_run: bool) -> None:
        started.append(rows)
        self.started_at, self.during_run = 0.0, during_run

    monkeypatch.setattr(StepBuilds, "start", start)
    publish_after = 5
    seen = {"steps": 0}
    original = DecodeSteps.pick

    def pick(self: DecodeSteps, *args: Any) -> Any:
        if started:
            seen["steps"] += 1
            if seen["steps"] == publish_after:
                shutil.copytree(built / packaged_step.FOLDER, tmp_path / packaged_step.FOLDER,
                                dirs_exist_ok=True)
        return original(self, *args)

    monkeypatch.setattr(DecodeSteps, "pick", pick)
    mixed, engine = _run(lm, "auto", lengths)
    decode = engine.runner.model_pass.decode
    assert started == [[2, 1]]  # both lines in the cache's 2 rows: the 2-row step first
    assert mixed == eager  # the same tokens, eager then compiled
    assert decode.compiled is not None
    eager_steps = engine.eager_steps
    assert set(eager_steps) == {decode_steps.NOT_BUILT_YET}
    # The measured passes, the step that started the builder and those until the
    # package appeared (the last of them took it): no more.
    assert eager_steps[decode_steps.NOT_BUILT_YET] == \
        build_decision.MEASURED_PASSES + publish_after
    decode_passes = sum(1 for s in engine.step_times if s.kind == "decode")
    assert decode.compiled.steps + eager_steps[decode_steps.NOT_BUILT_YET] == decode_passes
    assert decode.compiled.steps > 30


def test_a_builder_that_fails_leaves_the_run_eager_and_says_why(
        lm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    monkeypatch.setenv(step_builds.ENV, "background")
    cache = RowCache(num_layers=2, rows=2, capacity=16)
    missing = BuildSource(str(tmp_path / "no-model"), "cpu", "float32", "none", "auto")
    steps = DecodeSteps("auto", lm.model, cache, 2, lm.device, False, missing)
    assert steps.builds is not None
    try:
        steps.builds.start([2, 1], during_run=True)
        assert steps.builds.wait(timeout=120) == 1
    finally:
        _stop(steps.builds)
    steps.note_eager(0.01)
    assert steps.eager_by == {decode_steps.BUILD_FAILED: 1}
    problem = steps.builds.problem()
    assert problem is not None and "no-model" in problem
    # Off: no builder at all, and the library's older rule.
    monkeypatch.setenv(step_builds.ENV, "off")
    assert DecodeSteps("auto", lm.model, cache, 2, lm.device, False, missing).builds is None
