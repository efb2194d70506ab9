"""Which one-token steps run compiled (`--compile auto|on|off`), and why the others ran
eager.

- `off`, `--deterministic`, a model or machine the compiled step does not cover: every
  step eager.
- `on`: every step compiled, a bucket's package built where it is missing (~1 min on 2
  cores, inside the run: what `aici-batch prepare` drives).
- `auto`: a bucket whose packaged step is ready runs compiled from its first step (it
  loads in ~10 ms). Where none is, the run starts eagerly and a builder process makes the
  packages (step_builds.py): at once where the forecast says a build pays within the run
  (build_decision.py, from the eager passes' measured time and the lines' budgets), else
  after the run's last line, for the next run. The step after a package appears on disk
  takes it. A library engine given no `BuildSource` (nothing to load in a builder), or
  with `AICI_BATCH_STEP_BUILDS=off`, keeps the older rule: it builds inside the run once
  AUTO_MIN_STEPS one-token steps are ahead.

Every one-token step is counted, compiled (`CompiledDecode.steps`) or eager by why
(`eager_by`): one of EAGER_REASONS, or the compiled step's own problem.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from aici_cli.core.errors import one_line
from aici_cli.engine.forward import build_decision, step_builds
from aici_cli.engine.forward import compiled as step
from aici_cli.engine.forward.cache import RowCache
from aici_cli.engine.forward.compiled import CompiledDecode, smallest_bucket, step_row_counts
from aici_cli.engine.forward.step_builds import BuildSource, StepBuilds

# A library engine without a builder (module docstring) builds a missing package inside
# the run once the work still ahead is at least this many one-token steps (an upper
# bound: lines may end before max_tokens). A build costs ~40-60 s once (default model, 2
# CPU cores) and saves ~8-10 ms of a batch-1 step (docs/speed.md).
AUTO_MIN_STEPS = 2000

# Why an `auto` step ran eager while the compiled step could run here.
NOT_BUILT_YET = "not built yet"  # the builder is at work, or the forecast not made yet
NOT_WORTH_BUILDING = "not worth building"  # the forecast: a build would not pay in this run
BUILD_FAILED = "build failed"
EAGER_REASONS = (NOT_BUILT_YET, NOT_WORTH_BUILDING, BUILD_FAILED)
# Seconds between forecasts while a build does not pay yet (more lines may be read).
FORECAST_EVERY_S = 1.0


class DecodeSteps:
    """Which one-token steps run compiled (module docstring). Built once per engine."""

    def __init__(self, mode: str, model: Any, cache: RowCache, rows: int,
                 device: torch.device, deterministic: bool,
                 source: BuildSource | None = None) -> None:
        """`source`: what a builder process loads to build the missing packages (`auto`
        on CPU; None: none is started)."""
        self.mode = "off" if deterministic else mode
        self.reason: str | None = None  # why `on`/`auto` runs eager
        self.compiled: CompiledDecode | None = None
        self.builds: StepBuilds | None = None
        self.forecast: build_decision.Forecast | None = None  # the latest, where made
        self.eager_by: dict[str, int] = {}  # one-token steps run eager, by why
        self._eager_s: list[float] = []  # the latest eager one-token passes' times
        self._forecast_at = -FORECAST_EVERY_S
        self._chosen = self.mode == "on"
        if self.mode == "off":
            return
        self.reason = step.unsupported(model) or step.compiler_problem(device)
        if self.reason is None:
            self.compiled = CompiledDecode(model, cache, rows, device,
                                           build_packages=True)
        if self.mode == "auto" and self.compiled is not None and source is not None \
                and device.type == "cpu" and step_builds.enabled():
            self.builds = StepBuilds(source, cache.rows)

    @property
    def chosen(self) -> bool:
        """One-token steps run compiled from now on (for `auto`: once it chose to)."""
        return self.compiled is not None and self._chosen

    def give_up(self, error: BaseException) -> None:
        """Compiling failed: every later step runs eagerly, and `reason` says why."""
        self.compiled = None
        self.reason = f"compiling failed: {one_line(error)}"[:300]

    def pick(self, steps_ahead: int, span_end: int = 0,
             rows_bound: int = 0) -> CompiledDecode | None:
        """The compiled step for this one-token step, or None to run it eagerly;
        `steps_ahead`: the run's estimate of the one-token steps still to come;
        `span_end`, `rows_bound`: the step's rows (`CompiledDecode.bucket`). For `auto`, a
        packaged step ready for the step's bucket is chosen at once: it costs nothing to
        start (packaged_step.py)."""
        compiled = self.compiled
        if compiled is None:
            return None
        if not self._chosen:
            if compiled.package_ready(span_end, rows_bound):
                self._chosen = True
                compiled.may_trace = self.builds is None and steps_ahead >= AUTO_MIN_STEPS
            elif self.builds is None:
                self._chosen = compiled.may_trace = steps_ahead >= AUTO_MIN_STEPS
            else:
                self._consider(steps_ahead, span_end, rows_bound)
        return compiled if self._chosen else None

    def note_eager(self, seconds: float) -> None:
        """A one-token step ran its pass eagerly in `seconds`: counted by why, and timed
        for the forecast."""
        why = self._eager_reason()
        self.eager_by[why] = self.eager_by.get(why, 0) + 1
        self._eager_s = [*self._eager_s[-31:], seconds]

    def run_ended(self) -> None:
        """The run wrote its last line: where some of its one-token steps ran eager, the
        packages its buckets take are missing and no builder started, start one now,
        for the next run (it outlives this one). A run of no one-token step (scored
        choices, prompts alone) builds nothing."""
        builds, compiled = self.builds, self.compiled
        if builds is None or compiled is None or builds.started or not self.eager_by:
            return
        order = self._order(0, 0)
        if not all(compiled.package_path(rows).is_file() for rows in order):
            builds.start(order, during_run=False)

    def _consider(self, steps_ahead: int, span_end: int, rows_bound: int) -> None:
        """`auto` without a package: start the builder now where the forecast says a
        build pays within the run (once MEASURED_PASSES eager passes are timed, then
        every FORECAST_EVERY_S while it does not)."""
        builds, compiled = self.builds, self.compiled
        assert builds is not None and compiled is not None
        now = time.perf_counter()
        if builds.started or len(self._eager_s) < build_decision.MEASURED_PASSES \
                or now - self._forecast_at < FORECAST_EVERY_S:
            return
        self._forecast_at = now
        folder = step_builds.folder()
        from aici_cli.models.kernels.probe import fingerprint

        self.forecast = build_decision.forecast(
            steps_ahead, statistics.median(self._eager_s),
            build_decision.recorded_build_s(folder, fingerprint("cpu")))
        if self.forecast.pays:
            builds.start(self._order(span_end, rows_bound), during_run=True)
            compiled.recheck_s = step_builds.RECHECK_S

    def _order(self, span_end: int, rows_bound: int) -> list[int]:
        """The buckets to build, the one this step would take first (the tail's smaller
        ones after it, largest first): every bucket a run of this cache takes."""
        assert self.compiled is not None
        rows = self.compiled.cache.rows
        first = smallest_bucket(max(span_end, rows_bound), rows) if rows_bound else rows
        rest = sorted((b for b in step_row_counts(rows) if b != first), reverse=True)
        return [first, *rest]

    def _eager_reason(self) -> str:
        """Why a one-token step runs eager now."""
        if self.compiled is None:
            return self.reason or "--compile off"
        builds = self.builds
        if builds is None:
            return self.compiled.package_problem or NOT_WORTH_BUILDING
        if builds.started:
            return BUILD_FAILED if builds.problem() is not None else NOT_BUILT_YET
        if self.forecast is not None and not self.forecast.pays:
            return NOT_WORTH_BUILDING
        return NOT_BUILT_YET
