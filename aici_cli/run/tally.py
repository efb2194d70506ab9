"""The figures of a run: the run summary over results and the engine's step timings
(the figures themselves are declared in `core/line_stats.py`)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aici_cli.core.line_stats import STEP_FIELDS, StepTimes


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def step_summary(steps: Iterable[StepTimes]) -> dict[str, dict[str, float]]:
    steps = list(steps)
    out: dict[str, dict[str, float]] = {}
    for name in STEP_FIELDS:
        vals = [float(getattr(s, name)) for s in steps]
        out[name] = {
            "p50": round(percentile(vals, 50), 3),
            "p99": round(percentile(vals, 99), 3),
            "mean": round(sum(vals) / len(vals), 3) if vals else 0.0,
        }
    return out


@dataclass
class RunTally:
    """Counts results as they are written; `run_summary` turns them into the stats file.
    `aici-batch report` counts a results file with the same rules (a subclass)."""

    lines: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ff_tokens: int = 0
    row_forward_passes: int = 0  # sum over sequences: each gives at most one sampled token
    schema_lines: int = 0  # JSON-schema outputs of lines that ran to the end
    valid: int = 0  # of those, the ones valid under their schema
    schema_errors: int = 0  # JSON-schema outputs that never came: the line's error
    # Outputs finished early (early_close.py), by close_reason, and the valid outputs the
    # model finished itself: compliance with and without the closed ones.
    closed: dict[str, int] = field(default_factory=dict)
    valid_unclosed: int = 0
    answered: int = 0  # lines with an expected `answer`
    correct: int = 0
    error_types: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    first_error: dict[str, str] | None = None  # the first error result written: type, message
    # Tool calls by server (run/tools): calls, failed (the line's error), tool_errors (the
    # tool's own, told to the model), ms (each call's time, added up).
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    first_at: float | None = None  # `perf_counter` when the first result was added

    def add(self, result: dict[str, Any]) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.lines += 1
        reason = str(result.get("finish_reason", "stop"))
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        st = result.get("stats", {})
        self.prompt_tokens += int(st.get("prompt_tokens", 0))
        self.cached_tokens += int(st.get("cached_tokens", 0))
        self.output_tokens += int(st.get("output_tokens", 0))
        self.ff_tokens += int(st.get("ff_tokens", 0))
        self.row_forward_passes += int(st.get("forward_passes", 0))
        self._add_calls(result.get("transcript") or ())
        if "correct" in result:
            self.answered += 1
            self.correct += bool(result["correct"])
        if result.get("finish_reason") == "error":
            self.errors += 1
            error = result.get("error", {})
            etype = error.get("type", "error")
            self.error_types[etype] = self.error_types.get(etype, 0) + 1
            if self.first_error is None:
                self.first_error = {"type": etype, "message": str(error.get("message", ""))}
            # A schema line's error carries `valid: false`: JSONSchemaBench's compliance
            # counts it against the engine, compliance among the lines that ran does not.
            samples = result.get("choices", [result])
            if "valid" in result or any("valid" in sample for sample in samples):
                self.schema_errors += len(samples)
        else:
            # A line with n samples counts each sample's output for compliance.
            for sample in result.get("choices", [result]):
                why = sample.get("stats", {}).get("close_reason")
                if why is not None:
                    self.closed[why] = self.closed.get(why, 0) + 1
                if "valid" in sample:
                    self.schema_lines += 1
                    self.valid += bool(sample["valid"])
                    self.valid_unclosed += bool(sample["valid"]) and why is None

    def _add_calls(self, transcript: Iterable[dict[str, Any]]) -> None:
        for message in transcript:
            if message.get("role") != "tool":
                continue
            server = self.tools.setdefault(str(message.get("server", "")),
                                           {"calls": 0, "failed": 0, "tool_errors": 0, "ms": 0.0})
            server["calls"] += 1
            server["failed"] += "error" in message
            server["tool_errors"] += bool(message.get("is_error"))
            server["ms"] = round(server["ms"] + float(message.get("ms", 0.0)), 3)

    def counts(self) -> dict[str, Any]:
        """The figures results alone give, as named in the run summary."""
        rows = self.row_forward_passes
        per_token = round(rows / self.output_tokens, 4) if self.output_tokens else None
        return {
            "lines": self.lines,
            "errors": self.errors,
            "error_types": _by_count(self.error_types),
            **({"first_error": self.first_error} if self.first_error is not None else {}),
            "finish_reasons": _by_count(self.finish_reasons),
            "prompt_tokens": self.prompt_tokens,
            # Prompt tokens taken from the prefix cache: prefill computation saved.
            "cached_tokens": self.cached_tokens,
            "prefix_hit_rate": (
                round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens
                else None
            ),
            "output_tokens": self.output_tokens,
            "ff_tokens": self.ff_tokens,
            "row_forward_passes": rows,
            # Per sequence (row passes / output tokens): below 1.0 exactly by what
            # fast-forward and drafts saved. `forward_passes_per_token` is its old name.
            "row_passes_per_output_token": per_token,
            "forward_passes_per_token": per_token,
            "schema_lines": self.schema_lines,
            "valid": self.valid,
            "schema_errors": self.schema_errors,
            **compliance(self.valid, self.schema_lines, self.schema_errors),
            "closed_early": self._closed_early(),
            "valid_unclosed": self.valid_unclosed,
            # Compliance counting only outputs the model finished itself (not closed early).
            "compliance_unclosed": compliance(self.valid_unclosed, self.schema_lines,
                                              self.schema_errors)["compliance"],
            "answered": self.answered,
            "accuracy": round(self.correct / self.answered, 4) if self.answered else None,
            **({"tools": self.tools} if self.tools else {}),
        }

    def _closed_early(self) -> dict[str, int]:
        """Outputs finished early by close_reason; `loop_unclosable` (cut where a loop
        began, nothing could close it) only where there was one."""
        closed = {"limit": self.closed.get("limit", 0), "loop": self.closed.get("loop", 0)}
        if self.closed.get("loop_unclosable"):
            closed["loop_unclosable"] = self.closed["loop_unclosable"]
        return closed

    def run_summary(self, steps: Sequence[StepTimes], wall_s: float,
                meta: dict[str, Any]) -> dict[str, Any]:
        """The run summary (`--stats-out`); `batched_forward_passes` (and its old name
        `forward_passes`) counts the engine's batched passes."""
        return {
            **self.counts(),
            "batched_forward_passes": len(steps),
            "forward_passes": len(steps),
            "wall_s": round(wall_s, 3),
            "tokens_per_s": round(self.output_tokens / wall_s, 2) if wall_s > 0 else 0.0,
            "lines_per_s": round(self.lines / wall_s, 3) if wall_s > 0 else 0.0,
            "steps": step_summary(steps),
            **meta,
        }


def _restarts(count: int) -> str:
    """A server's restarts after crashes, for its row (nothing where none)."""
    return f", {count} restart{'s' if count > 1 else ''}" if count else ""


def _by_count(counts: dict[str, int]) -> dict[str, int]:
    """Most frequent first (ties in the order first seen)."""
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def compliance(valid: int, ran: int, errors: int) -> dict[str, float | None]:
    """Schema compliance both ways: `compliance` over every line with a JSON schema
    (JSONSchemaBench's: a schema the engine refuses, or a line that failed, counts as
    not valid), and `compliance_ran` over the lines that ran to the end."""
    every = ran + errors
    return {"compliance": round(valid / every, 4) if every else None,
            "compliance_ran": round(valid / ran, 4) if ran else None}


def compliance_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary tables' rows for schema compliance (none without schema lines)."""
    valid, ran = summary.get("valid", 0), summary.get("schema_lines", 0)
    every = ran + summary.get("schema_errors", 0)
    if not every:
        return []

    def share(total: int) -> str:
        return f"{valid}/{total} ({valid / total:.1%})" if total else f"{valid}/0"

    closed = summary.get("closed_early") or {}
    unclosed = summary.get("valid_unclosed", valid)
    cut = closed.get("loop_unclosable", 0)
    rows = [("schema outputs valid, of all schema lines", share(every)),
            ("schema outputs valid, of those that ran", share(ran))]
    if closed.get("limit") or closed.get("loop"):
        rows.append(("closed early (at the limit / on a loop)",
                     f"{closed.get('limit', 0)} / {closed.get('loop', 0)}"))
        rows.append(("valid without closing, of all schema lines",
                     f"{unclosed}/{every} ({unclosed / every:.1%})"))
    if cut:
        rows.append(("cut where an unclosable loop began", str(cut)))
    return rows


def outcome_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary tables' first rows (run and report alike): lines, errors by type,
    finish reasons."""
    rows = [("lines", str(summary["lines"])), ("errors", str(summary["errors"]))]
    rows += [(f"  error {etype}", str(count))
             for etype, count in summary.get("error_types", {}).items()]
    reasons = summary.get("finish_reasons", {})
    if reasons:
        rows.append(("finish reasons", ", ".join(f"{k} {v}" for k, v in reasons.items())))
    for server, calls in (summary.get("tools") or {}).items():
        rows.append((f"tool calls to {server}",
                     f"{calls['calls']} ({calls['failed']} failed, {calls['tool_errors']} "
                     f"tool errors), {calls['ms'] / 1000:.2f} s"
                     + _restarts(calls.get("restarts", 0))))
    return rows
