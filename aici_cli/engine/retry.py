"""Another attempt at a line generated with a relaxed schema (`--schema-fallback relax`)
whose output does not validate against the line's own schema.

The relaxed schema lets through outputs the original rejects, so such a line is generated
again, up to `--schema-retries` times, each attempt with the next seed. Greedy decoding
would repeat the same output, so a greedy line's retries sample at `RETRY_TEMPERATURE`;
a line with its own temperature keeps it. The result is the last attempt's, with
`attempts` and the work of every attempt in its stats; `valid` is never forced: a line
whose last attempt does not validate says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aici_cli.core.job import Job
from aici_cli.core.line_stats import summed_stats
from aici_cli.engine.logits.sampler import MIN_TEMPERATURE

RETRY_TEMPERATURE = 0.7

_SEEDS = 1 << 63  # seeds are non-negative 63-bit integers (the input line's range)


def next_attempt(job: Job, result: dict[str, Any], retries: int) -> Job | None:
    """The line's next attempt, or None when `result` (of one generation, n = 1) is final:
    its schema was not relaxed, its output validates, it ended in an error, or the
    retries are spent."""
    if (not result.get("relaxed") or result.get("valid") is not False
            or result["finish_reason"] == "error" or job.attempt >= retries or job.n > 1):
        return None
    s = job.sampling
    temperature = s.temperature if s.temperature >= MIN_TEMPERATURE else RETRY_TEMPERATURE
    sampling = dataclasses.replace(s, seed=(s.seed + 1) % _SEEDS, temperature=temperature)
    return dataclasses.replace(job, attempt=job.attempt + 1, sampling=sampling)


def with_attempts(result: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A relaxed line's final result: `attempts`, and with earlier attempts, their work
    added to its stats (the first attempt's time to first token, the attempts' times
    added up: they ran one after another)."""
    if "relaxed" not in result:
        return result
    result["attempts"] = len(earlier) + 1
    if earlier:
        attempts = [*earlier, result]
        stats = summed_stats(attempts)
        stats["ttft_ms"] = earlier[0]["stats"]["ttft_ms"]
        stats["total_ms"] = round(sum(r["stats"]["total_ms"] for r in attempts), 3)
        result["stats"] = stats
    return result
