"""`aici-batch report --plot`: the step-time split and distribution as a PNG (matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aici_cli.stats import percentile
from aici_cli.vocabulary.errors import ReportError


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
    (Long because it lays out both panels, top to bottom.)
    """
    figure_cls = pyplot_figure()
    out = Path(out)
    if totals_source is None:
        totals_source = summary.get("step_source")
    fig = figure_cls(figsize=(11, 4.8), layout="constrained")
    ax_split, ax_hist = fig.subplots(1, 2, width_ratios=[1, 2])

    steps = summary.get("steps") or {}
    source = summary.get("step_source")
    means = {name: float(steps[f"{name}_ms"]["mean"]) for name in
             ("forward", "mask", "controller", "sample") if f"{name}_ms" in steps}
    if "step_ms" in steps and means:
        means["other"] = max(0.0, float(steps["step_ms"]["mean"]) - sum(means.values()))
    if means:
        bottom = 0.0
        total = sum(means.values())
        for name, value in means.items():
            ax_split.bar(0, value, bottom=bottom, width=0.6, label=f"{name} {value:.2f} ms",
                         color=_SPLIT_COLORS[name])
            if total > 0 and value / total > 0.06:
                ax_split.text(0, bottom + value / 2, f"{value:.2f}", ha="center",
                              va="center", color="white", fontsize=9)
            bottom += value
        ax_split.set_xlim(-0.8, 1.9)
        ax_split.set_xticks([])
        ax_split.set_ylabel("mean ms per step")
        ax_split.legend(loc="upper right", fontsize=8, frameon=False, reverse=True)
        per = "batched pass" if source == "stats" else "sequence-step"
        ax_split.set_title(f"Step time split (mean per {per})\ntotal {total:.2f} ms",
                           fontsize=10)
    else:
        ax_split.text(0.5, 0.5, "no step timings", ha="center", va="center")
        ax_split.set_axis_off()

    values = [float(v) for v in step_totals]
    if values:
        bins = max(10, min(60, int(math.sqrt(len(values)) * 2)))
        ax_hist.hist(values, bins=bins, color="#4c72b0", alpha=0.85)
        for q, style in ((50, "--"), (99, ":")):
            v = percentile(values, q)
            ax_hist.axvline(v, color="black", linestyle=style, linewidth=1,
                            label=f"p{q} {v:.2f} ms")
        ax_hist.legend(fontsize=8, frameon=False)
        ax_hist.set_xlabel("ms (forward + mask + controller + sample)")
        what = {"steps": "sequence-steps", "per-sequence": "sequences, mean per pass"}.get(
            totals_source or "", "values")
        if source == "stats":
            what += ", from the results"
        ax_hist.set_ylabel("count")
        ax_hist.set_title(f"Step time distribution ({len(values)} {what})", fontsize=10)
    else:
        ax_hist.text(0.5, 0.5, "no per-step data", ha="center", va="center")
        ax_hist.set_axis_off()

    fig.suptitle(f"aici-batch report: {summary.get('lines', 0)} lines", fontsize=11)
    fig.savefig(out, format="png", dpi=110)
    return out
