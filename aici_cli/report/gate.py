"""`aici-batch report --fail-under METRIC=VALUE`: a run's figures as a CI gate.

| metric | bound | from |
| --- | --- | --- |
| accuracy | at least VALUE | lines with an expected `answer` |
| compliance | at least VALUE | valid JSON over every line with a schema, errors included |
| compliance_ran | at least VALUE | valid JSON over the schema lines that ran to the end |
| error_rate | at most VALUE | error lines over all lines |
| tokens_per_s | at least VALUE | the run summary (`--stats`) |

VALUE is a number, or a percentage for the shares (`70%`). A gate whose figure the
results cannot give (accuracy without any expected answer, compliance without schema
lines) fails too: a gate that silently passes on nothing would hide a broken eval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aici_cli.core.errors import ReportError


@dataclass(frozen=True)
class Metric:
    name: str
    upper: bool  # VALUE is a ceiling (lower is better)
    share: bool  # a fraction of lines, 0..1
    missing: str  # why the figure can be absent


METRICS = {m.name: m for m in (
    Metric("accuracy", False, True, "no line has an expected answer"),
    Metric("compliance", False, True, "no line asked for JSON under a schema"),
    Metric("compliance_ran", False, True, "no line with a schema ran to the end"),
    Metric("error_rate", True, True, "there are no lines"),
    Metric("tokens_per_s", False, False, "it needs --stats FILE (the run's --stats-out)"),
)}
ALIASES = {"tok/s": "tokens_per_s", "tokens/s": "tokens_per_s", "tok_s": "tokens_per_s",
           "errors": "error_rate", "error-rate": "error_rate"}


@dataclass(frozen=True)
class Gate:
    metric: Metric
    bound: float

    @property
    def text(self) -> str:
        return f"{self.metric.name} {'<=' if self.metric.upper else '>='} {self.bound:g}"


def parse_gate(spec: str) -> Gate:
    """`METRIC=VALUE` as a Gate; ReportError naming what is wrong."""
    name, eq, value = spec.partition("=")
    name = ALIASES.get(name.strip().lower(), name.strip().lower())
    if not eq or name not in METRICS:
        raise ReportError(f"--fail-under {spec!r}: expected METRIC=VALUE with METRIC one of "
                          f"{', '.join(METRICS)}")
    metric = METRICS[name]
    value = value.strip()
    try:
        bound = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise ReportError(f"--fail-under {spec!r}: {value!r} is not a number") from None
    if not math.isfinite(bound) or bound < 0 or (metric.share and bound > 1):
        limit = "between 0 and 1 (or 0% and 100%)" if metric.share else "at least 0"
        raise ReportError(f"--fail-under {spec!r}: {name} must be {limit}")
    return Gate(metric, bound)


def figure(summary: dict[str, Any], metric: Metric) -> float | None:
    """The summary's value of `metric`, or None when it has none."""
    if metric.name == "error_rate":
        return summary["errors"] / summary["lines"] if summary["lines"] else None
    value = summary.get(metric.name)
    return float(value) if value is not None else None


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float | None

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        if self.gate.metric.upper:
            return self.value <= self.gate.bound
        return self.value >= self.gate.bound

    @property
    def reason(self) -> str:
        """One line: why it failed (or what passed)."""
        m = self.gate.metric
        if self.value is None:
            return f"--fail-under {m.name}: no {m.name} to check: {m.missing}"
        shown = f"{self.value:.4f}" if m.share else f"{self.value:.1f}"
        if self.passed:
            return f"{m.name} {shown} passes {self.gate.text}"
        side = "above the allowed" if m.upper else "below the required"
        return f"{m.name} {shown} is {side} {self.gate.bound:g} (--fail-under {m.name})"

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.gate.metric.name, "bound": self.gate.bound,
                "upper": self.gate.metric.upper, "value": self.value, "passed": self.passed}


def check_gates(summary: dict[str, Any], gates: list[Gate]) -> list[GateResult]:
    return [GateResult(gate, figure(summary, gate.metric)) for gate in gates]
