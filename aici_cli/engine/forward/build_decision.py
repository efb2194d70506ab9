"""Whether building the compiled step beside a run pays within that run.

A run at `--compile auto` whose packaged steps are missing starts on the eager step
(step_builds.py builds them in a process of its own). On a machine of few cores the
build competes with the decoding it is meant to speed up: it starts niced, so it takes
mostly the cycles the run leaves idle (Python's work between passes, the masks), but
it still slows the run's passes a little, and it is ready only after a while. So the
run starts the build at once only where the eager time still ahead outlasts the build
by enough that the faster steps after it win back what the build cost; otherwise the
build starts after the run's last line is written, and the next run starts compiled.

    saved = (ahead - ready) * (1 - COMPILED_RATIO)      the compiled steps after it
    lost  = ready * SLOWDOWN                            the eager steps beside it
    pays  = saved > lost   (and ready < ahead)

`ahead` is the eager one-token pass time still to come: the one-token steps the lines'
budgets leave (their `max_tokens` less what they wrote, over the rows; lines read
ahead counted, the rest of the input not) times EXPECTED_USE (lines end before their
budget: JSON values close, end-of-sequence) times the eager pass's measured time.
`ready` is the build's time beside the run: its time alone on this machine (measured
by an earlier build here, `recorded_build_s`, else BUILD_S) over BESIDE_SHARE.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# One bucket's packaged step alone (export and AOT compile): ~45 s for the default model
# on 2 cores (prepare: 224 s for five); the estimate until a build here measured one.
BUILD_S = 45.0
# The share of its alone speed a niced build gets beside a decoding run on 2 cores (an
# estimate: the run leaves a core idle through its Python work between passes).
BESIDE_SHARE = 0.5
# The compiled pass's time over the eager one's (docs/speed.md: 7.98 against 16.17 ms
# at one row; 14-16 against ~22 ms at eight): an estimate until the run measured both.
COMPILED_RATIO = 0.6
# The fraction of a step the run loses while the build runs beside it (an estimate: the
# bound a cold run at the defaults must keep against `--compile off`).
SLOWDOWN = 0.05
# The share of the lines' remaining token budgets they are expected to use.
EXPECTED_USE = 0.6
# Eager one-token passes measured before the first decision (their median is the
# eager step time).
MEASURED_PASSES = 8

# The file, beside the packages, of the build times measured on this machine.
TIMES_FILE = "build-times.json"


@dataclass(frozen=True)
class Forecast:
    """A decision and its figures (seconds), for the summary and the tests."""

    pays: bool
    ahead_s: float  # the eager one-token pass time still to come (EXPECTED_USE applied)
    ready_s: float  # when the build would be ready, beside the run
    saved_s: float
    lost_s: float


def forecast(steps_ahead: int, eager_pass_s: float, build_s: float = BUILD_S,
             ratio: float = COMPILED_RATIO) -> Forecast:
    """Whether a build started now pays within the run (module docstring):
    `steps_ahead` one-token steps at most (the lines' budgets), each an eager pass of
    `eager_pass_s`; `build_s` the build's time alone; `ratio` compiled over eager."""
    ahead = max(0, steps_ahead) * EXPECTED_USE * eager_pass_s
    ready = build_s / BESIDE_SHARE
    saved = max(0.0, ahead - ready) * (1.0 - ratio)
    lost = min(ready, ahead) * SLOWDOWN
    return Forecast(ready < ahead and saved > lost, ahead, ready, saved, lost)


def recorded_build_s(folder: Path, machine: str) -> float:
    """The longest build time of one bucket measured on `machine` (build times are
    kept per machine in `folder`/TIMES_FILE), else BUILD_S."""
    try:
        times = json.loads((folder / TIMES_FILE).read_text()).get(machine)
    except (OSError, ValueError, AttributeError):
        return BUILD_S
    return float(max(times)) if isinstance(times, list) and times else BUILD_S


def record_build_s(folder: Path, machine: str, seconds: float) -> None:
    """Keep one measured build time for `machine` (the last 8), atomically."""
    path = folder / TIMES_FILE
    try:
        times = json.loads(path.read_text())
        if not isinstance(times, dict):
            times = {}
    except (OSError, ValueError):
        times = {}
    mine = [t for t in times.get(machine, []) if isinstance(t, (int, float))]
    times[machine] = [*mine, round(seconds, 2)][-8:]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(times, sort_keys=True))
    os.replace(tmp, path)
