"""The report's bandwidth section, from the job's ``orchestrate doctor`` result (``doctor.json``).

Two charts: all_reduce bus bandwidth against message size (log x, one line per backend) with
the band the doctor expects, and the node-by-node point-to-point bandwidth matrix. The shapes
read (``bandwidth.allreduce``, ``.expected``, ``.pairs``) are described in
:mod:`orchestrate.report.runfiles`. Pure: values in, HTML text out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from orchestrate.core.metricrecord import finite
from orchestrate.report import svg


def bandwidth_section(doctor: Mapping[str, Any] | None) -> list[str]:
    """The report's section for ``doctor.json`` (none without bandwidth figures)."""
    if not doctor:
        return []
    bandwidth = doctor.get("bandwidth") or {}
    if not isinstance(bandwidth, Mapping):
        return []
    out = ['<section id="doctor"><h2>Bandwidth (orchestrate doctor)</h2>']
    if doctor.get("verdict"):
        out.append(f'<p class="sub">doctor verdict: {escape(str(doctor["verdict"]))}</p>')
    sweep = bandwidth.get("allreduce") or []
    by_backend: dict[str, list[tuple[float, float]]] = {}
    for row in sweep:
        if not isinstance(row, Mapping):
            continue
        size = finite(row.get("size_bytes", row.get("bytes")))
        busbw = finite(row.get("busbw_GBps", row.get("busbw")))
        if size is not None and busbw is not None and size > 0 and busbw > 0:
            by_backend.setdefault(str(row.get("backend") or "all_reduce"), []).append(
                (size, busbw))
    if by_backend:
        sizes = sorted({s for points in by_backend.values() for s, _ in points})
        band = _band(bandwidth.get("expected"), sizes)
        lines = [svg.Series(f"busbw {name}", sorted(points), svg.PALETTE[i % len(svg.PALETTE)],
                            dots=True, data={"backend": name})
                 for i, (name, points) in enumerate(sorted(by_backend.items()))]
        out.append(svg.line_chart(lines, chart_id="busbw", title="all_reduce bus bandwidth "
                                  "against message size", x_label="message size",
                                  y_label="busbw (GB/s)", log_x=True, log_base=2, band=band,
                                  x_format=svg.size_bytes, y_zero=True))
    matrix = bandwidth.get("pairs")
    if isinstance(matrix, Mapping) and matrix.get("nodes"):
        names = [str(n) for n in matrix["nodes"]]
        values = [[finite(v) for v in row] for row in matrix.get("GBps") or []]
        out.append(svg.heatmap(names, names, values, chart_id="pairs",
                               title="point-to-point bandwidth between nodes (GB/s)",
                               value_format=lambda v: f"{v:.3g}"))
    out.append("</section>")
    return out


def _band(expected: Any, sizes: Sequence[float]) -> svg.Band | None:
    if not isinstance(expected, Mapping) or not sizes:
        return None
    low, high = finite(expected.get("low_GBps")), finite(expected.get("high_GBps"))
    floor = finite(expected.get("floor_GBps"))
    if floor is not None and (low is None or high is None):
        low, high = floor * 0.5, floor
    if low is None or high is None:
        return None
    return svg.Band(f"expected {low:.3g}-{high:.3g} GB/s",
                    [(sizes[0], low, high), (sizes[-1], low, high)])
