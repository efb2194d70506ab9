"""`aici-batch report` in a CI job: the gates, the comparison with the last run, and the
JUnit and Markdown outputs, all from the one pass over the results that the summary takes
(stdin can be read only once).

Exit codes of `aici-batch report` (docs/ci-reports.md has the table):
  0  the report was made; every `--fail-under` gate passed and, with
     `--fail-on-regression`, accuracy did not fall significantly;
  2  the report could not be made: a bad option, a file that cannot be read or written,
     a line that is not a result line;
  3  the report was made (and its files written), but a gate failed: one line on stderr
     per failed gate.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ReportError
from aici_cli.report.baseline import Comparison, compare, read_outcomes
from aici_cli.report.gate import Gate, GateResult, check_gates
from aici_cli.report.junit import write_junit
from aici_cli.report.lines import LineOutcome, line_outcome
from aici_cli.report.markdown import markdown
from aici_cli.report.summarize import report

GATE_FAILED = 3
STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


@dataclass(frozen=True)
class CiOptions:
    gates: tuple[Gate, ...] = ()
    baseline: str | None = None
    fail_on_regression: bool = False
    alpha: float = 0.05  # the significance level of --fail-on-regression
    junit: str | None = None
    markdown: str | None = None  # None: $GITHUB_STEP_SUMMARY when it is set


@dataclass
class CiReport:
    summary: dict[str, Any]
    gates: list[GateResult] = field(default_factory=list)
    comparison: Comparison | None = None
    regression: str | None = None  # why --fail-on-regression fails, or None
    markdown_to: str | None = None  # where the Markdown went

    @property
    def failures(self) -> list[str]:
        """One line per failed gate."""
        out = [g.reason for g in self.gates if not g.passed]
        return out + ([self.regression] if self.regression else [])

    @property
    def exit_code(self) -> int:
        return GATE_FAILED if self.failures else 0


def check_options(options: CiOptions, stats_path: str | Path | None) -> None:
    """Refuse option combinations that cannot work, before anything is read."""
    if options.fail_on_regression and options.baseline is None:
        raise ReportError("--fail-on-regression needs --baseline PREV.jsonl (the last run's "
                          "results)")
    if stats_path is None and any(g.metric.name == "tokens_per_s" for g in options.gates):
        raise ReportError("--fail-under tokens_per_s needs --stats FILE (the run's "
                          "--stats-out): results alone have no wall time")


def ci_report(results_path: str | Path, stats_path: str | Path | None = None,
              plot_to: str | Path | None = None, options: CiOptions = CiOptions(),
              environ: Mapping[str, str] = os.environ) -> CiReport:
    """The report of `aici_cli.report.summarize.report` plus what `options` ask for; the JUnit and
    Markdown files are written whether or not the gates pass. Raises ReportError."""
    check_options(options, stats_path)
    # The baseline first: a missing or malformed one fails before anything is written.
    before = read_outcomes(options.baseline) if options.baseline is not None else None
    lines: list[LineOutcome] = []
    summary = report(results_path, stats_path, plot_to,
                     on_result=lambda result: lines.append(line_outcome(result)))
    out = CiReport(summary, check_gates(summary, list(options.gates)))
    if options.gates:
        summary["gates"] = [g.as_dict() for g in out.gates]
    if before is not None:
        assert options.baseline is not None
        out.comparison = compare(lines, before, options.baseline)
        summary["baseline"] = out.comparison.as_dict()
        if options.fail_on_regression:
            out.regression = out.comparison.regression(options.alpha)
    title = "stdin" if str(results_path) == "-" else str(results_path)
    if options.junit is not None:
        write_junit(options.junit, lines, Path(title).stem or "results")
    out.markdown_to = options.markdown or environ.get(STEP_SUMMARY) or None
    if out.markdown_to is not None:
        text = markdown(title, summary, out.gates, out.comparison, out.regression)
        # The step summary collects every step's Markdown: add to it, never replace it.
        mode = "w" if options.markdown is not None else "a"
        try:
            with open(out.markdown_to, mode, encoding="utf-8") as fh:
                fh.write(text)
        except OSError as e:
            where = "--markdown" if options.markdown is not None else f"${STEP_SUMMARY}"
            raise ReportError(f"{where} {out.markdown_to}: cannot write it: "
                              f"{e.strerror or e}") from None
    return out
