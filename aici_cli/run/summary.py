"""The run summary (`--stats-out`, `schemas/stats.schema.json`): what a backend's engines
measured (`summarize`, the same for a local and a Ray run), the facts of the run around
them (`run_facts`: version, start, start-up, first result and total time), and its file
(`write_summary`). Torch-free.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aici_cli import __version__
from aici_cli.core.config import RunConfig
from aici_cli.core.line_stats import StepTimes
from aici_cli.run.controller_pin import controller_summary
from aici_cli.run.tally import RunTally, percentile

# The first result's `perf_counter`, between `summarize` and `run_facts` (which makes it
# `first_result_s`, from the run's start, and drops it).
_FIRST_AT = "_first_result_at"


def summarize(config: RunConfig, tally: RunTally, steps: list[StepTimes], wall: float,
              model: dict[str, Any], compiled: list[float],
              call_times: list[float]) -> dict[str, Any]:
    """The run summary from the results' tally and the engines' step times, grammar
    compile times and guest call times."""
    meta = {**model, "batch_size": config.engine.batch_size}
    summary = tally.run_summary(steps, wall, meta)
    if tally.first_at is not None:  # made seconds from the run's start by run_facts
        summary[_FIRST_AT] = tally.first_at
    if compiled:
        summary["grammar_compile_ms"] = {
            "grammars": len(compiled),
            "p50": round(percentile(compiled, 50), 3),
            "p99": round(percentile(compiled, 99), 3),
        }
    if config.controller is not None:
        summary["controller"] = controller_summary(config)
        summary["guest_call_ms"] = {
            "calls": len(call_times),
            "p50": round(percentile(call_times, 50), 3),
            "p99": round(percentile(call_times, 99), 3),
        }
    return summary


@dataclass
class RunStart:
    """When the run began (UTC, ISO 8601; and as a `perf_counter`), and how long start-up
    (imports, the model loading) took."""

    at: str
    t0: float
    load_s: float = 0.0

    @classmethod
    def since(cls, t0: float | None = None) -> RunStart:
        now = time.perf_counter()
        t0 = now if t0 is None else t0
        wall = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=now - t0)
        return cls(at=wall.isoformat(timespec="seconds"), t0=t0)


def run_facts(summary: dict[str, Any], config: RunConfig, started: RunStart | None,
              interrupted: bool) -> dict[str, Any]:
    """The run summary with what a log needs beside the figures: the version, when the run
    started, start-up, first result and total time, whether it was interrupted or
    ordered."""
    started = started or RunStart.since()
    first_at = summary.pop(_FIRST_AT, None)
    first = round(first_at - started.t0, 3) if first_at is not None else None
    return {**summary, "version": __version__, "started_at": started.at,
            "load_s": round(started.load_s, 3), "first_result_s": first,
            "total_s": round(time.perf_counter() - started.t0, 3),
            "interrupted": interrupted, "ordered": config.ordered}


def write_summary(path: str | None, summary: dict[str, Any]) -> str | None:
    """Write the `--stats-out` file; why it could not be written (checked before the run,
    its directory may still have gone since), or None."""
    if not path:
        return None
    try:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        return f"cannot write --stats-out {path}: {e.strerror or e}"
    return None
