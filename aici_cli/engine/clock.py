"""The step clock: named marks through one engine step, turned into its `StepTimes`."""

from __future__ import annotations

import time
from collections.abc import Callable

from aici_cli.core.line_stats import StepTimes

Now = Callable[[], float]  # seconds, monotonic; tests pass a fake


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000.0


class StepClock:
    """Marks of one step, in order: `start` (when the scheduler began the plan; default:
    at creation), `forward` (the pass begins), `forwarded`, `masks_ready` (the mask worker
    handed its masks over), `masked` (masks applied), `sampled`, `committed` (controllers
    answered)."""

    def __init__(self, now: Now = time.perf_counter, start: float | None = None) -> None:
        self.now = now
        self.marks: dict[str, float] = {"start": now() if start is None else start}

    def mark(self, name: str) -> None:
        self.marks[name] = self.now()

    def between(self, a: str, b: str) -> float:
        return ms(self.marks[a], self.marks[b])

    def times(self, kind: str, rows: int, tokens: int) -> StepTimes:
        """The step's timings once it is `sampled` (controller and step time are filled
        in by `finish`). Mask filling overlaps the pass: only what outlasts it counts."""
        return StepTimes(
            kind=kind,
            rows=rows,
            tokens=tokens,
            forward_ms=self.between("forward", "forwarded"),
            mask_ms=self.between("forwarded", "masked"),
            mask_wait_ms=self.between("forwarded", "masks_ready"),
            sample_ms=self.between("masked", "sampled"),
        )

    def finish(self, times: StepTimes, controller_ms: float) -> StepTimes:
        self.mark("committed")
        times.controller_ms = controller_ms
        times.step_ms = self.between("start", "committed")
        return times
