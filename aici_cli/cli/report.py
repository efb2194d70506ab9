"""`aici-batch report`: a finished run's summary from its results, and in CI its gates,
baseline comparison, JUnit, Markdown and a page (thin: the work is in `aici_cli.report`
(`summarize.py` and its neighbours), imported on use, none of which loads torch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from aici_cli.cli.errors import FatalError
from aici_cli.core.errors import UsageError

if TYPE_CHECKING:
    from aici_cli.report.checks import CiReport


@click.command()
@click.argument("results", metavar="RESULTS")
@click.option("--stats", "stats_file", type=click.Path(dir_okay=False), default=None,
              help="The run's --stats-out file, for run-level figures (wall time, tokens/s).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="Draw the per-step time split and step-time distribution (needs "
                   "matplotlib).")
@click.option("--timeline", "timeline_file", type=click.Path(dir_okay=False), default=None,
              help="Draw the run's lines as bars over wall time, coloured by finish reason, "
                   "with its engine steps underneath (from --trace's file when given; from "
                   "the results alone otherwise, without steps). Needs matplotlib.")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="The run's `run --trace` file, for --timeline and --html's timeline.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), default=None,
              help="Write the run as one self-contained page to open in a browser: its "
                   "figures and gates, a table of its lines to sort, filter and search, "
                   "each line's output, validator errors, tool calls and steps, the plots, "
                   "and with --baseline the changed answers. No network, no server.")
@click.option("--input", "input_file", type=click.Path(dir_okay=False), default=None,
              help="The run's input file, for --html: each line's prompt or messages, and "
                   "the JSON Schema that explains an invalid output.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead.")
@click.option("--fail-under", "fail_under", multiple=True, metavar="METRIC=VALUE",
              help="Exit 3 when METRIC is below VALUE (error_rate: above it): accuracy, "
                   "compliance, compliance_ran, error_rate, tokens_per_s (needs --stats). "
                   "Repeatable; VALUE may be a percentage (70%).")
@click.option("--baseline", type=click.Path(dir_okay=False), default=None,
              help="The last run's results: lines matched by id and input digest, changed "
                   "answers each way, the accuracy delta with a paired bootstrap 95% "
                   "interval and McNemar's p-value.")
@click.option("--fail-on-regression", is_flag=True,
              help="With --baseline: exit 3 when accuracy fell and McNemar's p is below "
                   "--alpha.")
@click.option("--alpha", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
              default=0.05, show_default=True,
              help="The significance level of --fail-on-regression.")
@click.option("--junit", "junit_file", type=click.Path(dir_okay=False), default=None,
              help="Write JUnit XML: one test case per line, failed when wrong, invalid or "
                   "an error.")
@click.option("--markdown", "markdown_file", type=click.Path(dir_okay=False), default=None,
              help="Write the report as Markdown; without it, appended to "
                   "$GITHUB_STEP_SUMMARY when that is set.")
def report(results: str, stats_file: str | None, plot_file: str | None,
           timeline_file: str | None, trace_file: str | None, html_file: str | None,
           input_file: str | None, as_json: bool,
           fail_under: tuple[str, ...], baseline: str | None, fail_on_regression: bool,
           alpha: float, junit_file: str | None, markdown_file: str | None) -> None:
    """Summarize a finished run from its RESULTS file ('-' for stdin): lines, errors,
    compliance where schemas applied, tokens/s, forward passes per token, step timings;
    in CI, gate on it, compare it with the last run, write JUnit, Markdown and a page.

    \b
    Examples:
      aici-batch report results.jsonl
      aici-batch report results.jsonl --stats stats.json --plot steps.png
      aici-batch report results.jsonl --trace trace.jsonl --timeline timeline.png
      aici-batch report results.jsonl --fail-under accuracy=0.7 --junit junit.xml
      aici-batch report results.jsonl --baseline prev.jsonl --fail-on-regression
      aici-batch report results.jsonl --input eval.jsonl --html report.html

    \b
    Exit status: 0 when every gate passed, 2 when the report could not be made (bad
    option, unreadable file, a line that is not a result), 3 when a gate failed (one line
    per failed gate on stderr; the JUnit and Markdown files are still written).
    """
    from aici_cli.core.errors import ReportError
    from aici_cli.report.checks import CiOptions, ci_report
    from aici_cli.report.gate import parse_gate
    from aici_cli.run.out_paths import check_writable

    if trace_file is not None and timeline_file is None and html_file is None:
        raise FatalError("--trace goes with --timeline or --html")
    if input_file is not None and html_file is None:
        raise FatalError("--input goes with --html")
    try:
        check_writable([("--plot", plot_file), ("--timeline", timeline_file),
                        ("--junit", junit_file), ("--markdown", markdown_file),
                        ("--html", html_file)])
        options = CiOptions(gates=tuple(parse_gate(g) for g in fail_under), baseline=baseline,
                            fail_on_regression=fail_on_regression, alpha=alpha,
                            junit=junit_file, markdown=markdown_file, html=html_file,
                            inputs=input_file, trace=trace_file)
        out = ci_report(results, stats_file, Path(plot_file) if plot_file else None, options)
        if timeline_file is not None:
            from aici_cli.report.timeline import draw_timeline

            draw_timeline(results, Path(timeline_file), trace_file)
    except (ReportError, UsageError) as e:
        raise FatalError(str(e)) from None
    except OSError as e:
        verb = "write" if plot_file is not None and e.filename == plot_file else "read"
        raise FatalError(f"cannot {verb} {e.filename}: {e.strerror}") from None
    _show(out, as_json)
    for reason in out.failures:
        click.echo(f"aici-batch report: gate failed: {reason}", err=True)
    sys.exit(out.exit_code)


def _show(out: CiReport, as_json: bool) -> None:
    """The summary on stdout: JSON, or the table with the baseline and the gates."""
    if as_json:
        click.echo(json.dumps(out.summary, indent=2))
        return
    from rich.console import Console

    from aici_cli.report.markdown import comparison_lines
    from aici_cli.report.summarize import report_table

    console = Console()
    console.print(report_table(out.summary))
    for line in comparison_lines(out.comparison) if out.comparison else []:
        console.print(f"baseline: {line}", markup=False, highlight=False)
    for gate in out.gates:
        console.print(f"gate: {gate.reason}", markup=False, highlight=False)
