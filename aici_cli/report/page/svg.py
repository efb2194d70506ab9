"""Just enough SVG for the page's plots, written as text: shapes, labels, linear scales
and round axis ticks. No matplotlib: `report --html` needs nothing `report` does not, and
a drawing inline in the page follows its colours (text is `currentColor`, so a dark page
gets light labels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape


def _num(value: float) -> str:
    """Coordinates to a tenth of a pixel: finer only makes the file bigger."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


@dataclass
class Scale:
    """A linear map from data (lo..hi) to pixels (start..end)."""

    lo: float
    hi: float
    start: float
    end: float

    def __call__(self, value: float) -> float:
        span = self.hi - self.lo
        if span <= 0:
            return self.start
        return self.start + (value - self.lo) / span * (self.end - self.start)


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values from lo to hi at a step of 1, 2 or 5 times a power of ten."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    out = []
    value = first
    while value <= hi + step * 1e-9:
        out.append(round(value, 10))
        value += step
    return out


def label(value: float) -> str:
    """A tick's text: no trailing zeros, thousands kept short."""
    if abs(value) >= 10_000:
        return f"{value / 1000:g}k"
    return f"{value:.6g}"


@dataclass
class Svg:
    width: int
    height: int
    title: str
    parts: list[str] = field(default_factory=list)

    def rect(self, x: float, y: float, w: float, h: float, fill: str,
             tip: str | None = None) -> None:
        shape = (f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0.0))}" '
                 f'height="{_num(max(h, 0.0))}" fill="{fill}"')
        self.parts.append(f"{shape}><title>{escape(tip)}</title></rect>" if tip
                          else f"{shape}/>")

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "currentColor",
             width: float = 1.0, dash: str | None = None) -> None:
        style = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" '
                          f'y2="{_num(y2)}" stroke="{stroke}" stroke-width="{width:g}"{style}/>')

    def text(self, x: float, y: float, text: str, size: int = 11, anchor: str = "start",
             fill: str = "currentColor", bold: bool = False) -> None:
        weight = ' font-weight="600"' if bold else ""
        self.parts.append(f'<text x="{_num(x)}" y="{_num(y)}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{fill}"{weight}>{escape(text)}</text>')

    def path(self, points: list[tuple[float, float]], fill: str, opacity: float = 1.0) -> None:
        d = "M" + "L".join(f"{_num(x)} {_num(y)}" for x, y in points) + "Z"
        self.parts.append(f'<path d="{d}" fill="{fill}" fill-opacity="{opacity:g}"/>')

    def x_axis(self, scale: Scale, y: float, caption: str) -> None:
        self.line(scale.start, y, scale.end, y, width=0.6)
        for value in ticks(scale.lo, scale.hi):
            x = scale(value)
            self.line(x, y, x, y + 4, width=0.6)
            self.text(x, y + 15, label(value), size=10, anchor="middle")
        self.text((scale.start + scale.end) / 2, y + 30, caption, size=10, anchor="middle")

    def y_axis(self, scale: Scale, x: float, caption: str) -> None:
        self.line(x, scale.start, x, scale.end, width=0.6)
        for value in ticks(scale.lo, scale.hi, 4):
            y = scale(value)
            self.line(x - 4, y, x, y, width=0.6)
            self.text(x - 6, y + 3, label(value), size=10, anchor="end")
        mid = (scale.start + scale.end) / 2
        self.parts.append(f'<text transform="translate({_num(x - 38)} {_num(mid)}) rotate(-90)" '
                          f'font-size="10" text-anchor="middle" fill="currentColor">'
                          f"{escape(caption)}</text>")

    def render(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width} '
                f'{self.height}" width="{self.width}" height="{self.height}" role="img" '
                f'aria-label="{escape(self.title)}" font-family="system-ui, sans-serif">'
                f"<title>{escape(self.title)}</title>{''.join(self.parts)}</svg>")
