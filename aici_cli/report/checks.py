"""`aici-batch report` in a CI job: the gates, the comparison with the last run, and the
JUnit, Markdown and HTML outputs, all from the one pass over the results that the summary
takes (stdin can be read only once).

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
from aici_cli.report.page.inputs import read_inputs
from aici_cli.report.page.rows import PageLines
from aici_cli.report.page.write import page_data, page_plots, write_page
from aici_cli.report.plot import plot, pyplot_figure
from aici_cli.report.summarize import read_report

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
    html: str | None = None
    inputs: str | None = None  # the run's input file (`--input`), for the page's prompts
    trace: str | None = None  # the run's trace (`--trace`), for the page's timeline


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


def _write_markdown(out: CiReport, title: str, options: CiOptions,
                    environ: Mapping[str, str]) -> None:
    out.markdown_to = options.markdown or environ.get(STEP_SUMMARY) or None
    if out.markdown_to is None:
        return
    text = markdown(title, out.summary, out.gates, out.comparison, out.regression)
    # The step summary collects every step's Markdown: add to it, never replace it.
    mode = "w" if options.markdown is not None else "a"
    try:
        with open(out.markdown_to, mode, encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        where = "--markdown" if options.markdown is not None else f"${STEP_SUMMARY}"
        raise ReportError(f"{where} {out.markdown_to}: cannot write it: "
                          f"{e.strerror or e}") from None


def ci_report(results_path: str | Path, stats_path: str | Path | None = None,
              plot_to: str | Path | None = None, options: CiOptions = CiOptions(),
              environ: Mapping[str, str] = os.environ) -> CiReport:
    """The report of `aici_cli.report.summarize.report` plus what `options` ask for; the
    JUnit, Markdown and HTML files are written whether or not the gates pass. Every one
    of them is made from the one summary `--json` prints. Raises ReportError."""
    check_options(options, stats_path)
    if plot_to is not None:
        pyplot_figure()  # fails fast without matplotlib
    # The baseline and the inputs first: a missing or malformed one fails before anything
    # is written.
    before = read_outcomes(options.baseline) if options.baseline is not None else None
    page = None
    if options.html is not None:
        page = PageLines(read_inputs(options.inputs) if options.inputs is not None else None)
    lines: list[LineOutcome] = []

    def on_result(result: dict[str, Any]) -> None:
        lines.append(line_outcome(result))
        if page is not None:
            page.add(result, lines[-1])

    # Per-line outcomes cost a third of a big report: made only when something reads them.
    wanted = options.junit is not None or before is not None or page is not None
    summary, tally = read_report(results_path, stats_path, on_result if wanted else None)
    if plot_to is not None:
        plot(summary, plot_to, tally.step_totals(), tally.step_source)
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
    if page is not None:
        assert options.html is not None
        if out.comparison is not None:
            page.mark_changes((c.now, c.way) for c in out.comparison.changes)
        write_page(options.html, page_data(title, summary, page,
                                           page_plots(page, tally, options.trace)))
    _write_markdown(out, title, options, environ)
    return out
