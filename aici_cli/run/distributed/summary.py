"""`RunFigures`: what the driver of a Ray run gathers for its summary, and the summary.

The workers' engine figures come with each chunk's end (`worker.Figures`: a lost chunk's
are lost with it); the driver adds per worker lines and tokens, its own cost per line (a
result's yield on its worker to its line written, transfer included) and the lines it
handed out again after a loss. The summary is a local run's (`summary.summarize`)
with a `ray` section.
"""

from __future__ import annotations

import time
from typing import Any

from aici_cli.core.config import RunConfig
from aici_cli.core.line_stats import StepTimes
from aici_cli.run.distributed.placement import Worker
from aici_cli.run.distributed.worker import Figures
from aici_cli.run.summary import summarize
from aici_cli.run.tally import RunTally, percentile

# What the summary says of the model, as the first worker's `ready` reported it.
MODEL_KEYS = ("model", "device", "dtype", "quantize")


class RunFigures:
    """The figures of one Ray run; see the module docstring."""

    def __init__(self) -> None:
        self.engines: list[Figures] = []  # the workers' step times etc., per chunk
        self.delivery_ms: list[float] = []  # per line: worker's yield to written
        self.reassigned = 0  # lines handed out again after their worker died

    def delivered(self, worker: Worker, result: dict[str, Any], sent_at: float) -> None:
        """A line's result from `worker` was written; it left the worker at `sent_at`."""
        worker.lines += 1
        worker.output_tokens += int(result.get("stats", {}).get("output_tokens", 0))
        self.delivery_ms.append((time.time() - sent_at) * 1000)

    def summary(self, config: RunConfig, tally: RunTally, wall: float,
                workers: list[Worker]) -> dict[str, Any]:
        steps: list[StepTimes] = []
        compiled: list[float] = []
        calls: list[float] = []
        for figures in self.engines:
            steps += figures.steps
            compiled += figures.compile_ms
            calls += figures.call_times
        info = workers[0].info
        model = {k: str(info[k]) for k in MODEL_KEYS if k in info}
        summary = summarize(config, tally, steps, wall, model, compiled, calls)
        summary["ray"] = self._ray_summary(wall, workers)
        return summary

    def _ray_summary(self, wall: float, workers: list[Worker]) -> dict[str, Any]:
        """Per worker lines/s and tokens/s over the run's wall time, the faults, and the
        driver's own cost per line."""
        def rate(n: int) -> float:
            return round(n / wall, 3) if wall > 0 else 0.0

        entries = []
        for w in workers:
            entry = {"worker": w.name, "node": str(w.info.get("node", "")), "lines": w.lines,
                     "output_tokens": w.output_tokens, "lines_per_s": rate(w.lines),
                     "tokens_per_s": rate(w.output_tokens), "losses": w.losses}
            if "controller" in w.info:
                entry["controller"] = w.info["controller"]
            entries.append(entry)
        delivery = self.delivery_ms
        return {
            "workers": entries,
            "worker_losses": sum(w.losses for w in workers),
            "lines_reassigned": self.reassigned,
            "driver_ms_per_line": {
                "p50": round(percentile(delivery, 50), 3),
                "p99": round(percentile(delivery, 99), 3),
                "mean": round(sum(delivery) / len(delivery), 3) if delivery else 0.0,
            },
        }
