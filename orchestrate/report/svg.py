"""Small chart primitives that return SVG text: line charts, stacked bars, timelines, heat maps.

The report (and the doctor's page) draws its charts with these instead of a plotting library:
matplotlib alone adds ~170 MB to every training environment, while a chart here is a few
kilobytes of text that opens offline, prints, and diffs. Output is deterministic: the same values
give the same bytes (coordinates are rounded to 0.1 px, nothing depends on time or randomness),
so charts can be compared as text in tests.

Each function returns one ``<svg>`` element with a ``viewBox`` (it scales with the page), a
``<title>`` tooltip on every data mark (hover text without JavaScript), and ``class`` /
``data-*`` attributes naming what each mark shows (``data-series``, ``data-rank``...), so that
tests and readers can find a chart's data in the markup. Pure: values in, text out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

from orchestrate.report.scales import (
    Axis,
    Format,
    compact,
    limits,
    log_ticks,
    milliseconds,
    nice_ticks,
    seconds,
    size_bytes,
    thin,
    widen,
)

#: Colours that stay apart for the colour-blind (Okabe-Ito) and a grey for context.
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442",
           "#000000")
HIGHLIGHT = "#d62728"
MUTED = "#8c96a0"
GRID = "#e3e6ea"
INK = "#222"


def _n(value: float) -> str:
    """A coordinate: 0.1 px resolution, no trailing zeros, never ``-0``."""
    text = f"{value:.1f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _attrs(data: Mapping[str, str]) -> str:
    return "".join(f' data-{k}="{escape(v)}"' for k, v in sorted(data.items()))


# --- line chart ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One line: (x, y) points in x order."""

    name: str
    points: Sequence[tuple[float, float]]
    color: str = PALETTE[0]
    width: float = 1.6
    dash: str | None = None
    dots: bool | None = None  # None: dots when there are at most 60 points
    data: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Marker:
    """A vertical line at ``x`` with a short label (a restart, a stall...)."""

    x: float
    label: str
    kind: str
    color: str = MUTED


@dataclass(frozen=True)
class Band:
    """A shaded range of expected values: (x, low, high) points in x order."""

    label: str
    points: Sequence[tuple[float, float, float]]
    color: str = "#2ca02c"


@dataclass(frozen=True)
class Canvas:
    """Size of a chart and its margins, in px."""

    width: float = 720
    height: float = 260
    left: float = 64
    right: float = 16
    top: float = 30
    bottom: float = 42


def _open(chart_id: str, kind: str, canvas: Canvas, title: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{escape(chart_id)}" class="chart {kind}" '
        f'width="{_n(canvas.width)}" height="{_n(canvas.height)}" '
        f'viewBox="0 0 {_n(canvas.width)} {_n(canvas.height)}" role="img" '
        f'font-family="sans-serif" font-size="11" fill="{INK}">',
        f"<title>{escape(title)}</title>",
        f'<text class="chart-title" x="{_n(canvas.left)}" y="18" font-size="13" '
        f'font-weight="600">{escape(title)}</text>',
    ]


def line_chart(
    series: Sequence[Series],
    *,
    chart_id: str,
    title: str,
    x_label: str,
    y_label: str,
    log_x: bool = False,
    log_y: bool = False,
    log_base: int = 10,
    markers: Sequence[Marker] = (),
    band: Band | None = None,
    x_format: Format = compact,
    y_format: Format = compact,
    y_zero: bool = False,
    canvas: Canvas = Canvas(),
    max_points: int = 1200,
) -> str:
    """Lines of y against x, with optional vertical markers, an expected band and log axes
    (``log_base`` 2 puts x ticks on powers of two: message sizes)."""
    xs = [x for s in series for x, _ in s.points] + [m.x for m in markers]
    ys = [y for s in series for _, y in s.points]
    if band is not None:
        xs += [x for x, _, _ in band.points]
        ys += [v for _, lo, hi in band.points for v in (lo, hi)]
    x_low, x_high = limits(xs, log=log_x, zero=False)
    y_low, y_high = limits(ys, log=log_y, zero=y_zero)
    x_ticks = log_ticks(x_low, x_high, log_base) if log_x else nice_ticks(x_low, x_high)
    if not log_y:
        y_low, y_high = widen(y_low, y_high)
    y_ticks = log_ticks(y_low, y_high) if log_y else nice_ticks(y_low, y_high)
    right = canvas.width - canvas.right
    bottom = canvas.height - canvas.bottom
    ax = Axis(x_low, x_high, canvas.left, right, log_x)
    ay = Axis(y_low, y_high, bottom, canvas.top, log_y)
    out = _open(chart_id, "line-chart", canvas, title)
    out += _axes(canvas, ax, ay, (x_ticks, y_ticks), (x_format, y_format), (x_label, y_label))
    if band is not None and band.points:
        upper = " ".join(f"{_n(ax(x))},{_n(ay(hi))}" for x, _, hi in band.points)
        lower = " ".join(f"{_n(ax(x))},{_n(ay(lo))}" for x, lo, _ in reversed(band.points))
        out.append(f'<polygon class="band" points="{upper} {lower}" fill="{band.color}" '
                   f'fill-opacity="0.15" stroke="none"><title>{escape(band.label)}</title>'
                   "</polygon>")
    out += _markers(markers, canvas, ax, x_format)
    for s in series:
        out.extend(_line(s, ax, ay, x_format, y_format, max_points))
    out.extend(_legend([(s.name, s.color) for s in series]
                       + ([(band.label, band.color)] if band is not None else []),
                       right, canvas.top - 14))
    out.append("</svg>")
    return "\n".join(out)


def _axes(canvas: Canvas, ax: Axis, ay: Axis, ticks: tuple[Sequence[float], Sequence[float]],
          formats: tuple[Format, Format], labels: tuple[str, str]) -> list[str]:
    """The grid, the ticks of both axes, the x axis line and the axis labels."""
    (x_ticks, y_ticks), (x_format, y_format), (x_label, y_label) = ticks, formats, labels
    right = canvas.width - canvas.right
    bottom = canvas.height - canvas.bottom
    out = ['<g class="grid" stroke="' + GRID + '" stroke-width="1">']
    for t in y_ticks:
        out.append(f'<line x1="{_n(canvas.left)}" x2="{_n(right)}" y1="{_n(ay(t))}" '
                   f'y2="{_n(ay(t))}"/>')
    out.append("</g>")
    out.append('<g class="y-ticks" text-anchor="end">')
    for t in y_ticks:
        out.append(f'<text x="{_n(canvas.left - 6)}" y="{_n(ay(t) + 4)}">'
                   f"{escape(y_format(t))}</text>")
    out.append("</g>")
    out.append('<g class="x-ticks" text-anchor="middle">')
    for t in x_ticks:
        out.append(f'<line x1="{_n(ax(t))}" x2="{_n(ax(t))}" y1="{_n(bottom)}" '
                   f'y2="{_n(bottom + 4)}" stroke="{INK}"/>')
        out.append(f'<text x="{_n(ax(t))}" y="{_n(bottom + 16)}">{escape(x_format(t))}</text>')
    out.append("</g>")
    out.append(f'<line class="axis" x1="{_n(canvas.left)}" x2="{_n(right)}" y1="{_n(bottom)}" '
               f'y2="{_n(bottom)}" stroke="{INK}"/>')
    out.append(f'<text class="x-label" x="{_n((canvas.left + right) / 2)}" '
               f'y="{_n(canvas.height - 6)}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text class="y-label" transform="translate(14 {_n((canvas.top + bottom) / 2)}) '
               f'rotate(-90)" text-anchor="middle">{escape(y_label)}</text>')
    return out


def _markers(markers: Sequence[Marker], canvas: Canvas, ax: Axis, x_format: Format
             ) -> list[str]:
    """Dashed vertical lines with staggered labels (close markers keep apart)."""
    out = []
    bottom = canvas.height - canvas.bottom
    for i, m in enumerate(sorted(markers, key=lambda m: m.x)):
        x = _n(ax(m.x))
        label_y = canvas.top + 10 + 12 * (i % 3)
        out.append(
            f'<g class="marker {escape(m.kind)}" data-x="{escape(repr(float(m.x)))}">'
            f'<line x1="{x}" x2="{x}" y1="{_n(canvas.top)}" y2="{_n(bottom)}" '
            f'stroke="{m.color}" stroke-width="1.2" stroke-dasharray="4 3"/>'
            f'<text x="{_n(ax(m.x) + 3)}" y="{_n(label_y)}" fill="{m.color}" '
            f'font-size="10">{escape(m.label)}</text>'
            f"<title>{escape(m.label)} at {escape(x_format(m.x))}</title></g>"
        )
    return out


def _line(s: Series, ax: Axis, ay: Axis, x_format: Format, y_format: Format,
          max_points: int) -> list[str]:
    points = [(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)
              and (not ax.log or x > 0) and (not ay.log or y > 0)]
    drawn = thin(points, max_points)
    dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
    out = [f'<g class="series" data-series="{escape(s.name)}" data-points="{len(points)}"'
           f"{_attrs(s.data)}>"]
    if drawn:
        path = " ".join(f"{_n(ax(x))},{_n(ay(y))}" for x, y in drawn)
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" '
                   f'stroke-width="{_n(s.width)}" stroke-linejoin="round"{dash}/>')
    if s.dots if s.dots is not None else len(points) <= 60:
        for x, y in points:
            out.append(f'<circle class="point" cx="{_n(ax(x))}" cy="{_n(ay(y))}" r="2.6" '
                       f'fill="{s.color}"><title>{escape(s.name)}: {escape(y_format(y))} at '
                       f"{escape(x_format(x))}</title></circle>")
    out.append("</g>")
    return out


def _legend(entries: Sequence[tuple[str, str]], right: float, y: float) -> list[str]:
    if not entries:
        return []
    out = ['<g class="legend" font-size="10">']
    x = right
    for name, color in reversed(entries):
        width = 6.2 * len(name) + 16
        x -= width
        out.append(f'<rect x="{_n(x)}" y="{_n(y - 7)}" width="10" height="3" fill="{color}"/>'
                   f'<text x="{_n(x + 13)}" y="{_n(y - 3)}">{escape(name)}</text>')
    out.append("</g>")
    return out


# --- stacked horizontal bars -------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One row: a label, one value per part, a note at its end, optionally highlighted."""

    label: str
    values: Sequence[float]
    note: str = ""
    highlight: bool = False
    data: Mapping[str, str] = field(default_factory=dict)


def stacked_bars(
    bars: Sequence[Bar],
    parts: Sequence[tuple[str, str]],
    *,
    chart_id: str,
    title: str,
    x_label: str,
    value_format: Format = compact,
    width: float = 720,
    row_height: float = 22,
    label_width: float | None = None,
) -> str:
    """Horizontal bars, each split into ``parts`` (name, colour); highlighted rows are outlined
    and labelled in the highlight colour. ``label_width`` (px) defaults to the longest label's."""
    if label_width is None:
        label_width = max(90.0, max((7.0 * len(b.label) for b in bars), default=0.0) + 12)
    top, bottom_margin = 34.0, 40.0
    note_width = max((7.2 * len(b.note) for b in bars), default=0.0) + 16
    height = top + row_height * max(len(bars), 1) + bottom_margin
    canvas = Canvas(width=width, height=height, left=label_width)
    right = width - note_width
    high = max((sum(max(v, 0.0) for v in b.values) for b in bars), default=0.0)
    ticks = nice_ticks(0.0, high or 1.0)
    ax = Axis(0.0, max(high, ticks[-1]) or 1.0, label_width, right)
    bottom = top + row_height * max(len(bars), 1)
    out = _open(chart_id, "stacked-bars", canvas, title)
    for t in ticks:
        out.append(f'<line x1="{_n(ax(t))}" x2="{_n(ax(t))}" y1="{_n(top)}" y2="{_n(bottom)}" '
                   f'stroke="{GRID}"/><text x="{_n(ax(t))}" y="{_n(bottom + 14)}" '
                   f'text-anchor="middle">{escape(value_format(t))}</text>')
    out.append(f'<text class="x-label" x="{_n((label_width + right) / 2)}" '
               f'y="{_n(height - 8)}" text-anchor="middle">{escape(x_label)}</text>')
    for i, bar in enumerate(bars):
        y = top + i * row_height + 3
        h = row_height - 6
        cls = "bar highlight" if bar.highlight else "bar"
        color = HIGHLIGHT if bar.highlight else INK
        weight = ' font-weight="700"' if bar.highlight else ""
        out.append(f'<g class="{cls}"{_attrs(bar.data)}>')
        out.append(f'<text x="{_n(label_width - 6)}" y="{_n(y + h / 2 + 4)}" text-anchor="end" '
                   f'fill="{color}"{weight}>{escape(bar.label)}</text>')
        x = 0.0
        for (name, part_color), value in zip(parts, bar.values, strict=False):
            value = max(value, 0.0)
            out.append(
                f'<rect class="part" data-part="{escape(name)}" x="{_n(ax(x))}" y="{_n(y)}" '
                f'width="{_n(ax(x + value) - ax(x))}" height="{_n(h)}" fill="{part_color}">'
                f"<title>{escape(bar.label)}: {escape(name)} {escape(value_format(value))}"
                "</title></rect>"
            )
            x += value
        if bar.highlight:
            out.append(f'<rect class="outline" x="{_n(ax(0) - 2)}" y="{_n(y - 2)}" '
                       f'width="{_n(ax(x) - ax(0) + 4)}" height="{_n(h + 4)}" fill="none" '
                       f'stroke="{HIGHLIGHT}" stroke-width="2"/>')
        if bar.note:
            out.append(f'<text class="note" x="{_n(ax(x) + 6)}" y="{_n(y + h / 2 + 4)}" '
                       f'fill="{color}"{weight}>{escape(bar.note)}</text>')
        out.append("</g>")
    out.extend(_legend(list(parts), width - 8, top - 4))
    out.append("</svg>")
    return "\n".join(out)


# --- timeline ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A stretch of time on one row of a timeline (an attempt, a stall...)."""

    start: float
    end: float
    label: str
    kind: str
    color: str = PALETTE[0]
    row: str = "job"


@dataclass(frozen=True)
class Event:
    """A moment on a timeline (submitted, first step, a checkpoint...); ``caption``: a short
    text written next to it (the label is always its tooltip)."""

    t: float
    label: str
    kind: str
    color: str = INK
    row: str = "events"
    caption: str = ""


def timeline(
    spans: Sequence[Span],
    events: Sequence[Event],
    *,
    chart_id: str,
    title: str,
    origin: float,
    t_format: Format = seconds,
    width: float = 720,
    row_height: float = 30,
) -> str:
    """Rows of spans and events against time since ``origin`` (labels are relative times)."""
    rows: list[str] = []
    for row in [s.row for s in spans] + [e.row for e in events]:
        if row not in rows:
            rows.append(row)
    times = [v - origin for s in spans for v in (s.start, s.end)] + [e.t - origin for e in events]
    low, high = limits(times or [0.0, 1.0], log=False, zero=True)
    ticks = nice_ticks(low, high)
    high = max(high, ticks[-1])
    top, label_width = 30.0, 90.0
    bottom = top + row_height * max(len(rows), 1)
    height = bottom + 40
    canvas = Canvas(width=width, height=height, left=label_width)
    ax = Axis(low, high, label_width, width - 24)
    out = _open(chart_id, "timeline", canvas, title)
    for t in ticks:
        out.append(f'<line x1="{_n(ax(t))}" x2="{_n(ax(t))}" y1="{_n(top)}" y2="{_n(bottom)}" '
                   f'stroke="{GRID}"/><text x="{_n(ax(t))}" y="{_n(bottom + 14)}" '
                   f'text-anchor="middle">{escape(t_format(t))}</text>')
    out.append(f'<text class="x-label" x="{_n((label_width + width) / 2)}" y="{_n(height - 8)}" '
               'text-anchor="middle">time since submission</text>')
    for i, row in enumerate(rows):
        out.append(f'<text class="row" x="{_n(label_width - 8)}" '
                   f'y="{_n(top + i * row_height + row_height / 2 + 4)}" '
                   f'text-anchor="end">{escape(row)}</text>')
    for s in spans:
        y = top + rows.index(s.row) * row_height + 6
        x0, x1 = ax(s.start - origin), ax(s.end - origin)
        out.append(
            f'<g class="span {escape(s.kind)}"><rect x="{_n(x0)}" y="{_n(y)}" '
            f'width="{_n(max(x1 - x0, 1.5))}" height="{_n(row_height - 12)}" fill="{s.color}" '
            f'fill-opacity="0.75" rx="2"><title>{escape(s.label)}: '
            f"{escape(t_format(s.start - origin))} to {escape(t_format(s.end - origin))}"
            f'</title></rect><text x="{_n(x0 + 4)}" y="{_n(y + row_height / 2 - 2)}" '
            f'font-size="10" fill="#fff">{escape(s.label)}</text></g>'
        )
    captions = 0
    for e in events:
        y = top + rows.index(e.row) * row_height + row_height / 2
        x = ax(e.t - origin)
        caption = ""
        if e.caption:
            # Alternate above and below, so that captions of close events do not collide.
            dy = -9 if captions % 2 == 0 else 17
            captions += 1
            anchor = "end" if x > width * 0.8 else "start"
            caption = (f'<text x="{_n(x - 7 if anchor == "end" else x + 7)}" y="{_n(y + dy)}" '
                       f'font-size="10" text-anchor="{anchor}">{escape(e.caption)}</text>')
        out.append(
            f'<g class="event {escape(e.kind)}"><path d="M{_n(x)},{_n(y - 6)} l5,6 l-5,6 '
            f'l-5,-6 z" fill="{e.color}"><title>{escape(e.label)} at '
            f"{escape(t_format(e.t - origin))}</title></path>{caption}</g>"
        )
    out.append("</svg>")
    return "\n".join(out)


# --- heat map ----------------------------------------------------------------------------------


def _mix(low: str, high: str, share: float) -> str:
    a = [int(low[i: i + 2], 16) for i in (1, 3, 5)]
    b = [int(high[i: i + 2], 16) for i in (1, 3, 5)]
    share = min(max(share, 0.0), 1.0)
    return "#" + "".join(f"{round(x + (y - x) * share):02x}" for x, y in zip(a, b, strict=True))


def heatmap(
    rows: Sequence[str],
    columns: Sequence[str],
    values: Sequence[Sequence[float | None]],
    *,
    chart_id: str,
    title: str,
    value_format: Format = compact,
    low_color: str = "#fde0dd",
    high_color: str = "#08519c",
    scale: tuple[float, float] | None = None,
    cell: float = 46,
) -> str:
    """A matrix of cells coloured from ``low_color`` (the scale's low end) to ``high_color``;
    ``None`` cells (the diagonal, pairs not measured) are blank."""
    label_width, top = 110.0, 64.0
    width = max(label_width + cell * max(len(columns), 1) + 20,
                label_width + 7.6 * len(title) + 16)  # room for the title
    height = top + cell * max(len(rows), 1) + 20
    canvas = Canvas(width=width, height=height, left=label_width)
    numbers = [v for row in values for v in row if v is not None and math.isfinite(v)]
    low, high = scale or ((min(numbers), max(numbers)) if numbers else (0.0, 1.0))
    out = _open(chart_id, "heatmap", canvas, title)
    for j, name in enumerate(columns):
        x = label_width + j * cell + cell / 2
        out.append(f'<text class="column" transform="translate({_n(x + 4)} {_n(top - 6)}) '
                   f'rotate(-45)">{escape(name)}</text>')
    for i, name in enumerate(rows):
        y = top + i * cell
        out.append(f'<text class="row" x="{_n(label_width - 6)}" y="{_n(y + cell / 2 + 4)}" '
                   f'text-anchor="end">{escape(name)}</text>')
        for j, value in enumerate(values[i] if i < len(values) else []):
            x = label_width + j * cell
            if value is None or not math.isfinite(value):
                out.append(f'<rect class="cell empty" x="{_n(x + 1)}" y="{_n(y + 1)}" '
                           f'width="{_n(cell - 2)}" height="{_n(cell - 2)}" fill="#f6f7f8"/>')
                continue
            share = (value - low) / (high - low) if high > low else 1.0
            fill = _mix(low_color, high_color, share)
            text = "#fff" if share > 0.55 else INK
            out.append(
                f'<g class="cell" data-row="{escape(name)}" data-column="{escape(columns[j])}" '
                f'data-value="{escape(repr(float(value)))}"><rect x="{_n(x + 1)}" '
                f'y="{_n(y + 1)}" width="{_n(cell - 2)}" height="{_n(cell - 2)}" fill="{fill}">'
                f"<title>{escape(name)} → {escape(columns[j])}: {escape(value_format(value))}"
                f'</title></rect><text x="{_n(x + cell / 2)}" y="{_n(y + cell / 2 + 4)}" '
                f'text-anchor="middle" fill="{text}" font-size="10">'
                f"{escape(value_format(value))}</text></g>"
            )
    out.append("</svg>")
    return "\n".join(out)


#: The charts and their parts, and the number formats of :mod:`orchestrate.report.scales` that
#: label them (charts' callers pass them as ``x_format``/``value_format``).
__all__ = [
    "GRID", "HIGHLIGHT", "INK", "MUTED", "PALETTE", "Band", "Bar", "Canvas", "Event", "Format",
    "Marker", "Series", "Span", "compact", "heatmap", "line_chart", "milliseconds", "seconds",
    "size_bytes", "stacked_bars", "timeline",
]
