"""`--plot`'s figure as SVG for the page: the mean step split, stacked, and the
distribution of step totals with p50 and p99 marked (as `report/plot.py` draws it in a
PNG, from the same summary and totals)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from aici_cli.report.page.svg import Scale, Svg
from aici_cli.run.tally import percentile

SPLIT_COLORS = {"forward": "#4c72b0", "mask": "#dd8452", "controller": "#55a868",
                "sample": "#c44e52", "other": "#8c8c8c"}
WIDTH, HEIGHT = 920, 300
TOP, BOTTOM = 40, 250  # the plot area's rows of pixels


def split_means(steps: dict[str, Any]) -> dict[str, float]:
    """The mean ms per step of each part, plus "other" when the run summary has step_ms."""
    means = {name: float(steps[f"{name}_ms"]["mean"]) for name in
             ("forward", "mask", "controller", "sample") if f"{name}_ms" in steps}
    if "step_ms" in steps and means:
        means["other"] = max(0.0, float(steps["step_ms"]["mean"]) - sum(means.values()))
    return means


def _split(svg: Svg, means: dict[str, float], source: str | None) -> None:
    per = "batched pass" if source == "stats" else "sequence-step"
    total = sum(means.values())
    svg.text(20, 16, "Step time split", bold=True)
    svg.text(20, 30, f"mean per {per}: {total:.2f} ms", size=10)
    if not means:
        svg.text(140, 140, "no step timings", anchor="middle")
        return
    scale = Scale(0.0, total or 1.0, BOTTOM, TOP)
    svg.y_axis(scale, 70, "mean ms per step")
    bottom = 0.0
    for i, (name, value) in enumerate(means.items()):
        color = SPLIT_COLORS[name]
        svg.rect(90, scale(bottom + value), 60, scale(bottom) - scale(bottom + value), color,
                 f"{name}: {value:.3f} ms")
        svg.rect(165, TOP + 8 + i * 18, 10, 10, color)
        svg.text(180, TOP + 17 + i * 18, f"{name} {value:.2f} ms", size=10)
        bottom += value


def _distribution(svg: Svg, values: list[float], what: str) -> None:
    left, right = 400, WIDTH - 60
    svg.text(left - 40, 16, "Step time distribution", bold=True)
    svg.text(left - 40, 30, f"{len(values)} {what}", size=10)
    if not values:
        svg.text((left + right) / 2, 140, "no per-step data", anchor="middle")
        return
    lo, hi = min(values), max(values)
    bins = max(10, min(60, int(math.sqrt(len(values)) * 2)))
    width = (hi - lo) / bins or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    xs = Scale(lo, lo + width * bins, left, right)
    ys = Scale(0.0, float(max(counts)), BOTTOM, TOP)
    svg.y_axis(ys, left, "count")
    svg.x_axis(xs, BOTTOM, "ms (forward + mask + controller + sample)")
    for i, count in enumerate(counts):
        x0, x1 = xs(lo + i * width), xs(lo + (i + 1) * width)
        svg.rect(x0, ys(count), max(1.0, x1 - x0 - 1), BOTTOM - ys(count), "#4c72b0",
                 f"{lo + i * width:.2f}-{lo + (i + 1) * width:.2f} ms: {count}")
    for q, dash in ((50, "4 3"), (99, "1 2")):
        v = percentile(values, q)
        svg.line(xs(v), TOP, xs(v), BOTTOM, dash=dash)
        flip = xs(v) > right - 90  # a label past the right edge goes on the line's left
        svg.text(xs(v) + (-3 if flip else 3), TOP + 10 + (q == 99) * 12, f"p{q} {v:.2f} ms",
                 size=10, anchor="end" if flip else "start")


def step_svg(summary: dict[str, Any], step_totals: Sequence[float],
             totals_source: str | None) -> str:
    """The figure; panels without data say so, as the PNG's do."""
    source = summary.get("step_source")
    svg = Svg(WIDTH, HEIGHT, f"aici-batch report: step timings of {summary.get('lines', 0)} "
                             "lines")
    _split(svg, split_means(summary.get("steps") or {}), source)
    what = {"steps": "sequence-steps", "per-sequence": "sequences, mean per pass"}.get(
        totals_source or "", "values")
    _distribution(svg, [float(v) for v in step_totals], what)
    return svg.render()
