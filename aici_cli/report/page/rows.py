"""The page's lines: one row per result line for the table, and what the line shows
when opened, gathered during the report's one pass over the results.

A row is a list in `COLUMNS` order (the page holds 10,000 of them: names once, not per
row). Its status is the line's `LineOutcome.status`, the one JUnit uses; its counts of
invalid and closed outputs follow the run's tally (`aici_cli.run.tally.RunTally`), sample
by sample on lines that did not end in an error, so the page's filters count what
`report --json` counts.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from aici_cli.core.errors import ReportError
from aici_cli.report.lines import LineOutcome
from aici_cli.report.page.inputs import InputLine, input_of
from aici_cli.report.page.schema_errors import call_errors, output_errors
from aici_cli.report.timeline import Bar, result_bar

COLUMNS = ("index", "id", "finish", "status", "valid", "closed", "tokens", "prompt_tokens",
           "ttft_ms", "total_ms", "started_ms", "error", "correct", "invalid_outputs",
           "closed_outputs", "changed")
_CHANGED = COLUMNS.index("changed")
# Who the line is and what made it: in the row, or once for the run.
_NOT_DETAIL = ("id", "index", "input_sha256", "made_with")


def _samples(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result.get("choices", [result]))


def _counts(result: dict[str, Any]) -> tuple[int, int, str | None]:
    """(invalid outputs, outputs closed early, the first close reason), as the tally
    counts them: an error line's outputs never came, so they count as neither."""
    if result.get("finish_reason") == "error":
        return 0, 0, None
    invalid = closed = 0
    reason = None
    for sample in _samples(result):
        why = (sample.get("stats") or {}).get("close_reason")
        if why is not None:
            closed += 1
            reason = reason or why
        invalid += "valid" in sample and not sample["valid"]
    return invalid, closed, reason


def row(result: dict[str, Any], outcome: LineOutcome) -> list[Any]:
    stats = result.get("stats") or {}
    invalid, closed, reason = _counts(result)
    return [outcome.index, outcome.name, result.get("finish_reason"), outcome.status,
            outcome.valid, reason, stats.get("output_tokens"), stats.get("prompt_tokens"),
            stats.get("ttft_ms"), stats.get("total_ms"), stats.get("started_ms"),
            outcome.error[0] if outcome.error else None, result.get("correct"), invalid,
            closed, None]


def _explain(sample: dict[str, Any], line: InputLine) -> list[dict[str, str]] | None:
    """The errors that made a sample invalid, or None when the input has no schema."""
    if "tool_calls" in sample or line.fields.get("tools"):
        return call_errors(sample.get("tool_calls") or [], line.tool_schemas())
    schema = line.schema
    if schema is None:
        return None
    return output_errors(str(sample.get("text", "")), "json" in sample, sample.get("json"),
                         schema)


def _with_errors(sample: dict[str, Any], line: InputLine | None, why: str | None
                 ) -> dict[str, Any]:
    """`sample`, with its validator errors when it is an invalid output."""
    if sample.get("valid") is not False or sample.get("finish_reason") == "error":
        return sample
    errors = _explain(sample, line) if line is not None else None
    if errors is None:
        return {**sample, "schema_errors_note": why or "the input line has no JSON Schema"}
    return {**sample, "schema_errors": errors}


def detail(result: dict[str, Any], inputs: dict[int, InputLine] | None,
           run_made_with: str | None) -> dict[str, Any]:
    """What an opened line shows: the result's own fields, its input's prompt (or why
    there is none), for an invalid output its validator errors, and its `made_with`
    when it is not `run_made_with` (the run's, shown once for all lines)."""
    line, why = input_of(result, inputs)
    out = {k: v for k, v in result.items() if k not in _NOT_DETAIL}
    if "choices" in out:
        out["choices"] = [_with_errors(s, line, why) for s in out["choices"]]
    else:
        out = _with_errors(out, line, why)
    made_with = result.get("made_with")
    if made_with is not None and json.dumps(made_with, sort_keys=True) != run_made_with:
        out["made_with"] = made_with  # not the run's: say so on the line
    if line is not None:
        out["input"] = line.fields
    else:
        out["input_note"] = why
    return out


class PageLines:
    """The rows and details of every result line, in file order."""

    def __init__(self, inputs: dict[int, InputLine] | None = None) -> None:
        self.inputs = inputs
        self.rows: list[list[Any]] = []
        self.details: list[dict[str, Any]] = []
        self.made_with: Counter[str] = Counter()
        self._first_made_with: str | None = None
        self._position: dict[int, int] = {}  # id(outcome) -> its row
        self.bars: list[Bar] = []  # the timeline, from the results
        self.no_bars: str | None = None  # why the results cannot give the timeline

    def add(self, result: dict[str, Any], outcome: LineOutcome) -> None:
        made_with = result.get("made_with")
        key = json.dumps(made_with, sort_keys=True) if made_with is not None else None
        if key is not None:
            self.made_with[key] += 1
            # The first line's stands for the run's; a line made otherwise says so.
            self._first_made_with = self._first_made_with or key
        self._position[id(outcome)] = len(self.rows)
        self.rows.append(row(result, outcome))
        self.details.append(detail(result, self.inputs, self._first_made_with))
        if self.no_bars is None:
            try:
                bar = result_bar(result, outcome.index)
            except ReportError as e:
                self.no_bars = f"line {outcome.index}: {e}"
                return
            if bar is not None:
                self.bars.append(bar)

    def mark_changes(self, changes: Iterable[tuple[LineOutcome, str]]) -> None:
        """Mark the rows of lines whose answer changed since the baseline, by way."""
        for now, way in changes:
            self.rows[self._position[id(now)]][_CHANGED] = way

    def run_made_with(self) -> list[dict[str, Any]]:
        """What made the run's lines: each distinct `made_with`, with how many lines."""
        return [{"made_with": json.loads(k), "lines": n} for k, n in self.made_with.most_common()]
