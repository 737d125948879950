"""Chart scales and number formats: tick values, axes that map data onto pixels, thinning long
series, and the short numbers, sizes and durations that label them.

Used by :mod:`orchestrate.report.svg` (which offers the formats too). Pure: values in, values
out; deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Format = Callable[[float], str]


def compact(value: float) -> str:
    """A short number: 0.5, 12, 1.2k, 3.4M."""
    magnitude = abs(value)
    if magnitude >= 1e9:
        return f"{value / 1e9:.3g}G"
    if magnitude >= 1e6:
        return f"{value / 1e6:.3g}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.3g}k"
    if magnitude == 0:
        return "0"
    return f"{value:.3g}"


def size_bytes(value: float) -> str:
    """A byte count in binary units: 512B, 64K, 256M, 1G."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{unit}"
    return f"{value:.4g}B"


def seconds(value: float) -> str:
    """A duration: 45s, 3m05s, 2h10m."""
    total = round(value)
    sign = "-" if total < 0 else ""
    total = abs(total)
    if total < 60:
        return f"{sign}{total}s"
    if total < 3600:
        return f"{sign}{total // 60}m{total % 60:02d}s"
    return f"{sign}{total // 3600}h{total % 3600 // 60:02d}m"


def milliseconds(value: float) -> str:
    """Seconds shown in ms: 0.0123 -> 12.3ms."""
    return f"{value * 1000:.3g}ms"



def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0]
    if high <= low:
        return [low]
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def widen(low: float, high: float, count: int = 5) -> tuple[float, float]:
    """[low, high] widened to the nearest ticks outside it, so the data sit between ticks."""
    ticks = nice_ticks(low, high, count)
    if len(ticks) < 2:
        return low, high
    step = ticks[1] - ticks[0]
    return (ticks[0] - step if ticks[0] > low + 1e-12 else ticks[0],
            ticks[-1] + step if ticks[-1] < high - 1e-12 else ticks[-1])


def log_ticks(low: float, high: float, base: int = 10) -> list[float]:
    """Ticks for a log axis: powers of ``base`` (2 for byte sizes), at most about 10 of them
    (every second or third power when there are more); powers of 2 when a base-10 axis spans
    less than two decades."""
    if low <= 0 or high <= low:
        return [max(low, 1e-12)]
    if base == 10 and math.log10(high) - math.log10(low) < 2:
        base = 2
    first = math.ceil(math.log(low, base) - 1e-9)
    last = math.floor(math.log(high, base) + 1e-9)
    stride = max(1, math.ceil((last - first + 1) / 10))
    return [float(base) ** e for e in range(first, last + 1, stride)]


@dataclass(frozen=True)
class Axis:
    """Maps data values onto a pixel range, linearly or on a log scale."""

    low: float
    high: float
    start: float  # pixel of ``low``
    end: float  # pixel of ``high``
    log: bool = False

    def __call__(self, value: float) -> float:
        if self.log:
            value, low, high = (math.log10(max(v, 1e-300)) for v in (value, self.low, self.high))
        else:
            low, high = self.low, self.high
        if high == low:
            return (self.start + self.end) / 2
        return self.start + (value - low) / (high - low) * (self.end - self.start)


def limits(values: Sequence[float], *, log: bool, zero: bool) -> tuple[float, float]:
    """The range an axis spans for ``values`` (a log axis: the positive ones), from 0 with
    ``zero``, never empty."""
    finite = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
    if not finite:
        return (1.0, 10.0) if log else (0.0, 1.0)
    low, high = min(finite), max(finite)
    if zero and not log:
        low = min(low, 0.0)
    if high == low:
        if log:
            return low / 2, high * 2
        pad = abs(high) * 0.1 or 1.0
        return low - pad, high + pad
    return low, high


def thin(points: Sequence[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most about ``limit`` points keeping each bucket's first, lowest and highest point, so
    spikes survive (10,000 steps become ~``limit`` points, not an average that hides them)."""
    if len(points) <= limit:
        return list(points)
    buckets = max(1, limit // 3)
    size = len(points) / buckets
    kept: list[tuple[float, float]] = []
    for b in range(buckets):
        chunk = points[int(b * size): int((b + 1) * size)]
        if not chunk:
            continue
        picks = {0, min(range(len(chunk)), key=lambda i: chunk[i][1]),
                 max(range(len(chunk)), key=lambda i: chunk[i][1])}
        kept.extend(chunk[i] for i in sorted(picks))
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept
