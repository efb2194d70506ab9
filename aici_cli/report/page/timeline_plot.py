"""`--timeline`'s figure as SVG for the page: the run's lines over wall time, coloured by
finish reason, and its engine steps underneath when a trace gives them.

Drawn to stay small at any size of run: up to `BARS` lines each get a bar (and a tick at
the first token); past that, one bar a line would be thinner than a pixel, so the lines
in flight are drawn as a curve, one point per pixel column. Steps are merged the same
way, into the pixel columns they cover.
"""

from __future__ import annotations

from collections.abc import Sequence

from aici_cli.report.page.svg import Scale, Svg
from aici_cli.report.timeline import OTHER_COLOR, REASON_COLORS, STEP_COLORS, Bar, Step

BARS = 300
WIDTH, LEFT, RIGHT = 920, 70, 900
LANE = 34  # the steps' lane, under the lines


def _columns(spans: Sequence[tuple[float, float]], xs: Scale) -> list[tuple[int, int]]:
    """The pixel columns `spans` cover, merged into runs [start, end)."""
    covered = sorted((int(xs(a)), max(int(xs(a)) + 1, int(xs(b)) + 1)) for a, b in spans)
    runs: list[tuple[int, int]] = []
    for start, end in covered:
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


def _bars(svg: Svg, bars: list[Bar], xs: Scale, top: float, height: float) -> None:
    row = height / len(bars)
    for i, bar in enumerate(bars):
        y = top + i * row
        svg.rect(xs(bar.start), y, max(1.0, xs(bar.end) - xs(bar.start)), max(1.0, row * 0.8),
                 REASON_COLORS.get(bar.reason, OTHER_COLOR),
                 f"line {bar.index}: {bar.reason}, {bar.end - bar.start:.3f} s")
        if bar.first_token is not None:
            x = xs(bar.first_token)
            svg.line(x, y, x, y + max(1.0, row * 0.8), width=0.8)


def _legend(svg: Svg, bars: list[Bar]) -> None:
    """The finish reasons, with their counts, along the top right."""
    reasons = sorted({b.reason for b in bars})
    x = RIGHT - 100 * len(reasons)
    for reason in reasons:
        svg.rect(x, 9, 9, 9, REASON_COLORS.get(reason, OTHER_COLOR))
        svg.text(x + 13, 17, f"{reason or '?'} ({sum(b.reason == reason for b in bars)})",
                 size=10)
        x += 100


def _in_flight(svg: Svg, bars: list[Bar], xs: Scale, top: float, height: float) -> None:
    """The number of lines in flight at each pixel column, as a filled curve."""
    deltas = [0] * (RIGHT - LEFT + 2)
    for bar in bars:
        deltas[int(xs(bar.start)) - LEFT] += 1
        deltas[min(len(deltas) - 1, int(xs(bar.end)) - LEFT + 1)] -= 1
    level, levels = 0, []
    for d in deltas[:-1]:
        level += d
        levels.append(level)
    ys = Scale(0.0, float(max(levels) or 1), top + height, top)
    points = [(float(LEFT), top + height)]
    points += [(float(LEFT + i), ys(n)) for i, n in enumerate(levels)]
    points.append((float(LEFT + len(levels) - 1), top + height))
    svg.path(points, "#4c72b0", 0.8)
    svg.y_axis(ys, LEFT, "lines in flight")


def _steps(svg: Svg, steps: Sequence[Step] | None, xs: Scale, top: float) -> None:
    if not steps:
        svg.text((LEFT + RIGHT) / 2, top + LANE / 2 + 4, "steps are in the trace, not the "
                 "results: run --trace FILE, then report --trace FILE", size=10,
                 anchor="middle")
        return
    for lane, kind in enumerate(("prefill", "decode")):
        spans = [(s.start, s.end) for s in steps if s.kind == kind]
        y = top + lane * LANE / 2
        svg.text(LEFT - 6, y + 11, f"{kind} ({len(spans)})", size=9, anchor="end")
        for a, b in _columns(spans, xs):
            svg.rect(a, y + 2, b - a, LANE / 2 - 4, STEP_COLORS[kind])


def timeline_svg(bars: list[Bar], steps: Sequence[Step] | None, source: str) -> str:
    """The figure, its time axis from the first line (or step) admitted."""
    origin = min([b.start for b in bars] + [s.start for s in steps or ()])
    bars = sorted((Bar(b.index, b.start - origin, b.end - origin, b.reason,
                       None if b.first_token is None else b.first_token - origin)
                   for b in bars), key=lambda b: (b.start, b.index))
    shifted = [Step(s.start - origin, s.end - origin, s.kind) for s in steps or ()]
    end = max([b.end for b in bars] + [s.end for s in shifted] + [1e-3])
    height = 120 if len(bars) > BARS else min(420, 40 + 6 * len(bars))
    svg = Svg(WIDTH, 30 + height + LANE + 50, f"aici-batch timeline ({source})")
    svg.text(10, 18, f"Timeline ({source}): {len(bars)} lines from admission to result",
             bold=True)
    xs = Scale(0.0, end, LEFT, RIGHT)
    if len(bars) > BARS:
        _in_flight(svg, bars, xs, 30, height)
    else:
        _bars(svg, bars, xs, 30, height)
        _legend(svg, bars)
    _steps(svg, shifted, xs, 30 + height + 4)
    svg.x_axis(xs, 30 + height + LANE + 6, "seconds since the first line was admitted")
    return svg.render()
