"""`aici-batch report --html FILE`: the page, written as one file.

Everything is inline: the style, the scripts (the files of `assets/`, in `SCRIPTS`
order), the data (`payload.py`) and the plots (SVG text inside the data). The page's
Content-Security-Policy allows no fetch, no image, no font from anywhere, so a page that
opens from `file://` on a machine without network shows all it has, and one that tried
to load something would say so in the browser's console (the browser tests watch it).
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ReportError
from aici_cli.report.page.payload import element
from aici_cli.report.page.rows import COLUMNS, PageLines
from aici_cli.report.page.step_plot import step_svg
from aici_cli.report.page.timeline_plot import timeline_svg
from aici_cli.report.summarize import ResultTally
from aici_cli.report.timeline import Bar, Step, read_trace

SCRIPTS = ("util.js", "run.js", "table.js", "line.js", "boot.js")
DATA_VERSION = 1


@dataclass
class PagePlots:
    """What the page's plots are drawn from (the report's one pass gathered them)."""

    step_totals: Sequence[float]
    totals_source: str | None
    bars: list[Bar]
    steps: list[Step] | None = None  # from --trace
    timeline_source: str = "results"
    timeline_note: str | None = None  # why there is no timeline


def page_plots(lines: PageLines, tally: ResultTally, trace: str | Path | None) -> PagePlots:
    """The plots' data: the tally's step totals, and the timeline from the run's trace
    when given (with its steps), else from the results."""
    totals = tally.step_totals()
    if trace is not None:
        bars, steps = read_trace(Path(trace))
        return PagePlots(totals, tally.step_source, bars, steps, f"trace {Path(trace).name}")
    if lines.no_bars is not None:
        return PagePlots(totals, tally.step_source, [], timeline_note=lines.no_bars)
    return PagePlots(totals, tally.step_source, lines.bars)


def _asset(name: str) -> str:
    return (importlib.resources.files("aici_cli.report.page") / "assets" / name).read_text(
        encoding="utf-8")


def _plots(summary: dict[str, Any], plots: PagePlots) -> dict[str, str | None]:
    timeline = None
    note = plots.timeline_note
    if plots.bars:
        timeline = timeline_svg(plots.bars, plots.steps, plots.timeline_source)
    elif note is None:
        note = "no line ran: nothing to draw over time"
    return {"steps": step_svg(summary, plots.step_totals, plots.totals_source),
            "timeline": timeline, "timeline_note": note}


def page_data(title: str, summary: dict[str, Any], lines: PageLines,
              plots: PagePlots) -> dict[str, Any]:
    """Everything the page shows, as one JSON value: `summary` is the very object
    `report --json` prints."""
    return {"version": DATA_VERSION, "title": title, "summary": summary,
            "made_with": lines.run_made_with(), "columns": list(COLUMNS),
            "rows": lines.rows, "details": lines.details, "plots": _plots(summary, plots)}


def render(data: dict[str, Any]) -> str:
    """The page's HTML text."""
    script = "\n".join(_asset(name) for name in SCRIPTS)
    # `</script` cannot appear inside the element; the assets are ours and never hold it.
    assert "</script" not in script.lower()
    parts = {"title": escape(f"aici-batch report: {data['title']}"),
             "style": _asset("page.css"), "data": element(data), "script": script}
    # One pass: what is put in is never scanned again, so a model's output that reads
    # `{{script}}` stays text.
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], _asset("page.html"))


def write_page(path: str | Path, data: dict[str, Any]) -> None:
    try:
        Path(path).write_text(render(data), encoding="utf-8")
    except OSError as e:
        raise ReportError(f"--html {path}: cannot write it: {e.strerror or e}") from None
