"""Line charts as inline SVG for the report page: sharp at any size, a few kilobytes each.

Drawn in microseconds (a matplotlib figure takes a tenth of a second or more, at every run's
end). Each point names its series, epoch and value when pointed at (its SVG ``<title>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from imgtrainer.reports.page.html import esc

WIDTH, HEIGHT = 440, 270
LEFT, RIGHT, TOP, BOTTOM = 62, 12, 26, 40  # the plot area's margins
LEGEND_ROW = 17
# A legend entry's width: its line, then its label at up to 13 px (a phone's size, html.STYLE).
LEGEND_CHAR = 7.4
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
MARKERS_MAX_POINTS = 60  # more points than this: lines only


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    dash: str = ""  # an SVG stroke-dasharray: "" solid, "5 3" dashed, "2 3" dotted


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values covering [low, high] (1, 2 or 5 times a power of ten apart)."""
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0, 1.0]
    if high - low < 1e-12 * max(1.0, abs(high)):
        pad = abs(high) * 0.05 or 1.0
        # A constant count or difference of 0 is drawn from 0 up, not around it.
        low, high = (low if low == 0 else low - pad), high + pad
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def tick_label(value: float, ticks: Sequence[float]) -> str:
    span = max(abs(t) for t in ticks) or 1.0
    if value == 0:
        return "0"
    if span < 1e-2 or span >= 1e5:
        # 3.0e-3, not 3.0e-03: the y axis's labels stay within its margin on a phone too
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def line_chart(
    title: str,
    series: Sequence[Series],
    y_label: str = "",
    marked_x: float | None = None,
    marked_label: str = "best epoch",
) -> str:
    """An SVG line chart of ``series`` against the epoch, a dashed red line at ``marked_x``;
    "not recorded" when no series has a point."""
    series = [s for s in series if len(s.x)]
    xs = [x for s in series for x in s.x] + ([marked_x] if marked_x is not None else [])
    ys = [y for s in series for y in s.y if math.isfinite(y)]
    legend = [(s.label, COLOURS[i % len(COLOURS)], s.dash) for i, s in enumerate(series)]
    if series and marked_x is not None:
        legend.append((marked_label, "#d62728", "4 3"))
    rows = legend_rows(legend)
    height = HEIGHT + LEGEND_ROW * len(rows)
    parts = [
        f"<svg class='chart' viewBox='0 0 {WIDTH} {height}' role='img' aria-label='{esc(title)}' "
        f"xmlns='http://www.w3.org/2000/svg'><title>{esc(title)}</title>",
        f"<text x='{WIDTH / 2}' y='16' class='t'>{esc(title)}</text>",
    ]
    if not series or not ys:
        parts.append(f"<text x='{WIDTH / 2}' y='{HEIGHT / 2}' class='t'>not recorded</text></svg>")
        return "".join(parts)
    plot = Plot(min(xs), max(xs), nice_ticks(min(ys), max(ys)))
    parts.append(plot.axes(y_label))
    if marked_x is not None:
        x = plot.x(marked_x)
        parts.append(
            f"<line x1='{x:.1f}' y1='{TOP}' x2='{x:.1f}' y2='{HEIGHT - BOTTOM}' stroke='#d62728' "
            f"stroke-dasharray='4 3'/>"
        )
    for (_, colour, _), s in zip(legend, series, strict=False):
        parts.append(plot.line(s, colour))
    parts.append(legend_svg(rows))
    parts.append("</svg>")
    return "".join(parts)


class Plot:
    """Data to plot-area coordinates."""

    def __init__(self, x_low: float, x_high: float, y_ticks: list[float]):
        if x_high <= x_low:  # one epoch: its points in the middle, not on the y axis
            x_low, x_high = x_low - 0.5, x_low + 0.5
        self.x_low, self.x_high = x_low, x_high
        self.y_ticks = y_ticks
        self.y_low, self.y_high = y_ticks[0], y_ticks[-1]

    def x(self, value: float) -> float:
        share = (value - self.x_low) / (self.x_high - self.x_low)
        return LEFT + share * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        share = (value - self.y_low) / (self.y_high - self.y_low)
        return HEIGHT - BOTTOM - share * (HEIGHT - TOP - BOTTOM)

    def axes(self, y_label: str) -> str:
        bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
        parts = [
            f"<rect x='{LEFT}' y='{TOP}' width='{right - LEFT}' height='{bottom - TOP}' class='f'/>"
        ]
        for tick in self.y_ticks:
            y = self.y(tick)
            parts.append(f"<line x1='{LEFT}' y1='{y:.1f}' x2='{right}' y2='{y:.1f}' class='g'/>")
            parts.append(
                f"<text x='{LEFT - 4}' y='{y + 3.5:.1f}' class='yl'>{tick_label(tick, self.y_ticks)}</text>"
            )
        for tick in epoch_ticks(self.x_low, self.x_high):
            x = self.x(tick)
            parts.append(
                f"<line x1='{x:.1f}' y1='{bottom}' x2='{x:.1f}' y2='{bottom + 4}' class='a'/>"
            )
            parts.append(f"<text x='{x:.1f}' y='{bottom + 15}' class='xl'>{tick:g}</text>")
        parts.append(f"<text x='{(LEFT + right) / 2}' y='{bottom + 30}' class='xl'>epoch</text>")
        if y_label:
            parts.append(
                f"<text transform='translate(13 {(TOP + bottom) / 2}) rotate(-90)' class='xl'>"
                f"{esc(y_label)}</text>"
            )
        return "".join(parts)

    def line(self, s: Series, colour: str) -> str:
        points = [
            (self.x(x), self.y(y), x, y) for x, y in zip(s.x, s.y, strict=True) if math.isfinite(y)
        ]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _, _ in points)
        dash = f" stroke-dasharray='{s.dash}'" if s.dash else ""
        parts = [
            f"<polyline points='{path}' fill='none' stroke='{colour}' stroke-width='1.6'{dash}/>"
        ]
        if len(points) <= MARKERS_MAX_POINTS:
            for px, py, x, y in points:
                parts.append(
                    f"<circle cx='{px:.1f}' cy='{py:.1f}' r='2.4' fill='{colour}'>"
                    f"<title>{esc(s.label)}, epoch {x:g}: {y:.6g}</title></circle>"
                )
        return "".join(parts)


def epoch_ticks(low: float, high: float) -> list[float]:
    """Whole epochs, about 8 of them at most."""
    step = max(1, math.ceil((high - low) / 8))
    first = math.ceil(low)
    return [float(v) for v in range(first, int(high) + 1, step)] or [low]


def legend_rows(entries: list[tuple[str, str, str]]) -> list[list[tuple[str, str, str]]]:
    """The legend's entries in rows that fit the chart's width."""
    rows: list[list[tuple[str, str, str]]] = [[]]
    used = 0.0
    for entry in entries:
        width = 28 + LEGEND_CHAR * len(entry[0])
        if rows[-1] and used + width > WIDTH - 10:
            rows.append([])
            used = 0.0
        rows[-1].append(entry)
        used += width
    return [row for row in rows if row]


def legend_svg(rows: list[list[tuple[str, str, str]]]) -> str:
    parts = []
    for r, row in enumerate(rows):
        y = HEIGHT + 4 + r * LEGEND_ROW
        x = 10.0
        for label, colour, dash in row:
            pattern = f" stroke-dasharray='{dash}'" if dash else ""
            parts.append(
                f"<line x1='{x:.1f}' y1='{y:.1f}' x2='{x + 18:.1f}' y2='{y:.1f}' stroke='{colour}' "
                f"stroke-width='2'{pattern}/><text x='{x + 22:.1f}' y='{y + 4:.1f}' class='lg'>"
                f"{esc(label)}</text>"
            )
            x += 28 + LEGEND_CHAR * len(label)
    return "".join(parts)
