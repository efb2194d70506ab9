"""`aici-batch report --timeline`: a run's lines as bars over wall time, coloured by finish
reason, with its engine steps underneath (matplotlib, a PNG).

From a trace file (`run --trace`): every `line N` span is a bar from admission to result,
its `first_token` event a tick, and every `step` span a block on the lane below (prefill
and decode apart). From the results alone: each line's bar from `stats.started_ms` for
`stats.total_ms` (steps are not in results: that lane says so). The trace is read as
plain OTLP JSON, so this stays a light command (no OpenTelemetry, no torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ReportError
from aici_cli.report.plot import pyplot_figure

REASON_COLORS = {
    "stop": "#55a868", "length": "#dd8452", "tool_calls": "#4c72b0", "error": "#c44e52",
}
OTHER_COLOR = "#8c8c8c"
STEP_COLORS = {"prefill": "#8172b2", "decode": "#4c72b0"}


@dataclass(frozen=True)
class Bar:
    index: int
    start: float  # seconds from the run's start
    end: float
    reason: str
    first_token: float | None = None


@dataclass(frozen=True)
class Step:
    start: float
    end: float
    kind: str


def draw_timeline(results: str, out: Path, trace_file: str | None = None) -> Path:
    figure_cls = pyplot_figure()
    if trace_file is not None:
        bars, steps = read_trace(Path(trace_file))
        source = f"trace {Path(trace_file).name}"
    else:
        if results == "-":
            raise ReportError("--timeline reads RESULTS once more: give the results as a "
                              "file, or the run's --trace file with --trace")
        bars, steps = read_results(Path(results)), None
        source = f"results {Path(results).name}"
    if not bars:
        raise ReportError(f"--timeline: {source} holds no lines to draw")
    return _draw(figure_cls, bars, steps, source, out)


NO_START = ("the result has no stats.started_ms (an older aici-batch wrote it); draw the "
            "run's trace instead (run --trace, report --trace)")


def result_bar(r: dict[str, Any], n: int) -> Bar | None:
    """The bar of result line `r` (physical line `n`); None for a line that never ran (a
    bad input line has no place in time). Raises ReportError(NO_START) without
    `stats.started_ms`."""
    stats = r.get("stats") or {}
    if r.get("finish_reason") == "error" and not stats.get("forward_passes"):
        return None
    if "started_ms" not in stats:
        raise ReportError(NO_START)
    start = float(stats["started_ms"]) / 1000.0
    ttft = float(stats.get("ttft_ms") or 0.0) / 1000.0
    return Bar(int(r.get("index", n)), start,
               start + float(stats.get("total_ms") or 0.0) / 1000.0,
               str(r.get("finish_reason", "")), start + ttft if ttft else None)


def read_results(path: Path) -> list[Bar]:
    bars = []
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                r = json.loads(raw)
            except ValueError:
                raise ReportError(f"{path}:{n}: not JSON") from None
            try:
                bar = result_bar(r, n)
            except ReportError as e:
                raise ReportError(f"{path}:{n}: {e}") from None
            if bar is not None:
                bars.append(bar)
    return bars


def _attributes(span: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.get("attributes", []):
        value = kv.get("value", {})
        for kind in ("stringValue", "intValue", "doubleValue", "boolValue"):
            if kind in value:
                out[kv["key"]] = int(value[kind]) if kind == "intValue" else value[kind]
    return out


def read_trace(path: Path) -> tuple[list[Bar], list[Step]]:
    """The line and step spans of an OTLP JSON lines file (`run --trace`)."""
    spans: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for raw in f:
                if not raw.strip():
                    continue
                doc = json.loads(raw)
                for rs in doc.get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        spans.extend(ss.get("spans", []))
    except ValueError:
        raise ReportError(f"{path}: not OTLP JSON lines (a `run --trace` file)") from None
    if not spans:
        raise ReportError(f"{path} holds no spans (a `run --trace` file is OTLP JSON lines)")
    # From the first line or step (the run span also holds loading the model).
    timed = [s for s in spans if s.get("name", "").startswith("line ") or s.get("name") == "step"]
    origin = min(int(s["startTimeUnixNano"]) for s in (timed or spans))

    def sec(ns: Any) -> float:
        return (int(ns) - origin) / 1e9

    bars, steps = [], []
    for s in spans:
        name = s.get("name", "")
        if name.startswith("line "):
            a = _attributes(s)
            first = next((e["timeUnixNano"] for e in s.get("events", [])
                          if e.get("name") == "first_token"), None)
            bars.append(Bar(int(a.get("aici.line.index", 0)), sec(s["startTimeUnixNano"]),
                            sec(s["endTimeUnixNano"]), str(a.get("aici.finish_reason", "")),
                            sec(first) if first is not None else None))
        elif name == "step":
            steps.append(Step(sec(s["startTimeUnixNano"]), sec(s["endTimeUnixNano"]),
                              str(_attributes(s).get("aici.step.kind", "decode"))))
    return bars, steps


def _draw(figure_cls: Any, bars: list[Bar], steps: list[Step] | None, source: str,
          out: Path) -> Path:
    """Top: one row per line in admission order; bottom: the steps' lane."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    origin = min(b.start for b in bars)
    if steps:
        origin = min(origin, min(s.start for s in steps))
    bars = sorted((Bar(b.index, b.start - origin, b.end - origin, b.reason,
                       None if b.first_token is None else b.first_token - origin)
                   for b in bars), key=lambda b: (b.start, b.index))
    steps = [Step(s.start - origin, s.end - origin, s.kind) for s in steps or []]
    height = min(12.0, 2.6 + 0.12 * len(bars))
    fig = figure_cls(figsize=(11, height), layout="constrained")
    ax_lines, ax_steps = fig.subplots(2, 1, sharex=True, height_ratios=[5, 1])
    for row, bar in enumerate(bars):
        color = REASON_COLORS.get(bar.reason, OTHER_COLOR)
        ax_lines.barh(row, max(bar.end - bar.start, 1e-4), left=bar.start, height=0.8,
                      color=color)
        if bar.end - bar.start < 1e-3:  # answered at once (a bad line): a mark, not a bar
            ax_lines.plot([bar.start], [row], marker="x", color=color, markersize=6)
        if bar.first_token is not None:
            ax_lines.plot([bar.first_token] * 2, [row - 0.4, row + 0.4], color="black",
                          linewidth=0.8)
    handles: list[Any] = [
        Patch(color=REASON_COLORS.get(reason, OTHER_COLOR),
              label=f"{reason or '?'} ({sum(b.reason == reason for b in bars)})")
        for reason in sorted({b.reason for b in bars})]
    handles.append(Line2D([], [], color="black", linewidth=0.8, label="first token"))
    ax_lines.legend(handles=handles, loc="upper right", fontsize=8, frameon=False)
    ax_lines.invert_yaxis()
    if len(bars) <= 40:
        ax_lines.set_yticks(range(len(bars)), [f"line {b.index}" for b in bars], fontsize=7)
    else:
        ax_lines.set_ylabel(f"{len(bars)} lines, by admission")
        ax_lines.set_yticks([])
    ax_lines.set_title(f"aici-batch timeline ({source}): lines from admission to result",
                       fontsize=10)
    if steps:
        for kind, color in STEP_COLORS.items():
            blocks = [(s.start, max(s.end - s.start, 1e-4)) for s in steps if s.kind == kind]
            if blocks:
                lane = 1 if kind == "prefill" else 0
                ax_steps.broken_barh(blocks, (lane, 0.8), color=color,
                                     label=f"{kind} ({len(blocks)})")
        ax_steps.set_yticks([0.4, 1.4], ["decode", "prefill"], fontsize=8)
        ax_steps.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                        frameon=False)
        ax_steps.set_title(f"engine steps ({len(steps)} forward passes)", fontsize=9)
    else:
        ax_steps.text(0.5, 0.5, "steps are in the trace, not the results: "
                      "run --trace FILE, then report --trace FILE --timeline",
                      ha="center", va="center", transform=ax_steps.transAxes, fontsize=8)
        ax_steps.set_yticks([])
    ax_steps.set_xlabel("seconds since the first line was admitted")
    fig.savefig(out, format="png", dpi=110)
    return out
