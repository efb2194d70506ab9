"""`aici-batch report --plot`: the step-time split and distribution as a PNG (matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ReportError
from aici_cli.run.tally import percentile


def pyplot_figure() -> Any:
    """matplotlib's Figure class; an optional dependency (extra `plot`), so imported here.

    The object API (Figure + savefig) needs no pyplot and no GUI backend, so it works on
    a headless machine and leaves the global backend alone."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install matplotlib") from None
    return Figure


_SPLIT_COLORS = {
    "forward": "#4c72b0", "mask": "#dd8452", "controller": "#55a868",
    "sample": "#c44e52", "other": "#8c8c8c",
}


def plot(summary: dict[str, Any], out: str | Path, step_totals: Sequence[float] = (),
         totals_source: str | None = None) -> Path:
    """Draw the step-time split and the step-time distribution to a PNG; returns the path.

    Left: a stacked bar of the mean forward/mask/controller/sample ms per step from
    `summary["steps"]`, plus "other" (step_ms minus those) when the run summary gives
    step_ms. Right: a histogram of `step_totals` (forward+mask+controller+sample per
    sequence-step, or per-sequence averages; `report(..., plot_to=)` passes them, as a
    summary holds only percentiles). Panels without data say so rather than mislead.
    """
    figure_cls = pyplot_figure()
    out = Path(out)
    if totals_source is None:
        totals_source = summary.get("step_source")
    fig = figure_cls(figsize=(11, 4.8), layout="constrained")
    ax_split, ax_hist = fig.subplots(1, 2, width_ratios=[1, 2])
    source = summary.get("step_source")
    _draw_split(ax_split, summary.get("steps") or {}, source)
    _draw_distribution(ax_hist, [float(v) for v in step_totals], totals_source, source)
    fig.suptitle(f"aici-batch report: {summary.get('lines', 0)} lines", fontsize=11)
    fig.savefig(out, format="png", dpi=110)
    return out


def _draw_split(ax: Any, steps: dict[str, Any], source: str | None) -> None:
    """The left panel: the mean ms per step of each part, stacked; `source` "stats":
    the figures are per batched pass (the run summary), else per sequence-step."""
    means = {name: float(steps[f"{name}_ms"]["mean"]) for name in
             ("forward", "mask", "controller", "sample") if f"{name}_ms" in steps}
    if "step_ms" in steps and means:
        means["other"] = max(0.0, float(steps["step_ms"]["mean"]) - sum(means.values()))
    if not means:
        ax.text(0.5, 0.5, "no step timings", ha="center", va="center")
        ax.set_axis_off()
        return
    bottom = 0.0
    total = sum(means.values())
    for name, value in means.items():
        ax.bar(0, value, bottom=bottom, width=0.6, label=f"{name} {value:.2f} ms",
               color=_SPLIT_COLORS[name])
        if total > 0 and value / total > 0.06:
            ax.text(0, bottom + value / 2, f"{value:.2f}", ha="center",
                    va="center", color="white", fontsize=9)
        bottom += value
    ax.set_xlim(-0.8, 1.9)
    ax.set_xticks([])
    ax.set_ylabel("mean ms per step")
    ax.legend(loc="upper right", fontsize=8, frameon=False, reverse=True)
    per = "batched pass" if source == "stats" else "sequence-step"
    ax.set_title(f"Step time split (mean per {per})\ntotal {total:.2f} ms", fontsize=10)


def _draw_distribution(ax: Any, values: list[float], totals_source: str | None,
                       source: str | None) -> None:
    """The right panel: a histogram of the step totals, with p50 and p99 marked."""
    if not values:
        ax.text(0.5, 0.5, "no per-step data", ha="center", va="center")
        ax.set_axis_off()
        return
    from matplotlib.ticker import MaxNLocator  # matplotlib is there: `ax` is its Axes

    bins = max(10, min(60, int(math.sqrt(len(values)) * 2)))
    ax.hist(values, bins=bins, color="#4c72b0", alpha=0.85)
    # Counts are whole: with few values matplotlib's default ticks fall at 0.25, 1.75 ...
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for q, style in ((50, "--"), (99, ":")):
        v = percentile(values, q)
        ax.axvline(v, color="black", linestyle=style, linewidth=1, label=f"p{q} {v:.2f} ms")
    ax.legend(fontsize=8, frameon=False)
    ax.set_xlabel("ms (forward + mask + controller + sample)")
    what = {"steps": "sequence-steps", "per-sequence": "sequences, mean per pass"}.get(
        totals_source or "", "values")
    if source == "stats":
        what += ", from the results"
    ax.set_ylabel("count")
    ax.set_title(f"Step time distribution ({len(values)} {what})", fontsize=10)
