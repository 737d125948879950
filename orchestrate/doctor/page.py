"""The doctor's page: one self-contained HTML file (``doctor.html`` in the doctor job's run
directory) with every check, busbw against message size inside the expected band, and the
node-by-node bandwidth matrix.

Charts are inline SVG from :mod:`orchestrate.report.svg`, as in the run report: no script, font or
network, so the page opens offline, from a cluster's file system, attached to a ticket. Pure:
the doctor's document (:func:`orchestrate.doctor.grading.document`, with the bandwidth section of
:func:`orchestrate.doctor.findings.report_bandwidth`) in, text out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from orchestrate.report import svg

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;color:#222;background:#fafbfc}
main{max-width:1100px;margin:0 auto;padding:20px 28px}
h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:26px 0 8px}
.sub{color:#555;margin:2px 0}
.verdict{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-size:14px;
vertical-align:middle}
.pass{background:#2e7d32}.warn{background:#b7791f}.fail{background:#c62828}
table{border-collapse:collapse;width:100%;font-size:13px;background:#fff}
th,td{border-bottom:1px solid #e3e6ea;padding:5px 7px;text-align:left;vertical-align:top}
th{background:#f1f3f5}td.status span{display:inline-block;min-width:34px;text-align:center;
padding:1px 6px;border-radius:8px;color:#fff;font-size:12px}
td.hint{color:#444;font-size:12px}
svg{max-width:100%;height:auto;background:#fff;border:1px solid #e3e6ea;margin:6px 0}
footer{color:#777;font-size:12px;margin:28px 0 10px}
"""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def render(document: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    """The page. ``meta``: ``job_id``, ``backend``, ``tiers``, ``seconds``, ``nodes``,
    ``world_size``, ``generated`` (a time string), each optional."""
    verdict = str(document.get("verdict") or "pass")
    checks = [c for c in document.get("checks") or [] if isinstance(c, Mapping)]
    job = str(meta.get("job_id") or "")
    counts = {s: sum(1 for c in checks if c.get("status") == s) for s in ("pass", "warn", "fail")}
    bits = [f"{escape(str(meta.get('backend')))} backend" if meta.get("backend") else "",
            f"{len(meta.get('nodes') or [])} node(s)" if meta.get("nodes") else "",
            f"{meta.get('world_size')} rank(s)" if meta.get("world_size") else "",
            "tiers " + escape(", ".join(meta.get("tiers") or [])) if meta.get("tiers") else "",
            f"{float(meta['seconds']):.1f} s" if _number(meta.get("seconds")) is not None
            else ""]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(job)} - orchestrate doctor</title>",
        f"<style>{_CSS}</style></head><body><main>",
        f'<header><h1>orchestrate doctor {escape(job)} '
        f'<span class="verdict {escape(verdict)}">{escape(verdict)}</span></h1>',
        f'<p class="sub">{" · ".join(b for b in bits if b)}</p>',
        f'<p class="sub">{counts["pass"]} passed, {counts["warn"]} warning(s), '
        f'{counts["fail"]} failed</p></header>',
        *_checks(checks),
        *_bandwidth(document.get("bandwidth") or {}),
        f"<footer>orchestrate doctor{' for ' + escape(job) if job else ''}"
        + (f", written {escape(str(meta['generated']))}" if meta.get("generated") else "")
        + ". Self-contained: no scripts, fonts or network.</footer>",
        "</main></body></html>",
        "",
    ]
    return "\n".join(parts)


def _checks(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    out = ['<section id="checks"><h2>Checks</h2><table><thead><tr>'
           "<th>tier</th><th>check</th><th>node(s)</th><th>status</th><th>measured</th>"
           "<th>expected</th><th>detail</th></tr></thead><tbody>"]
    for c in checks:
        status = str(c.get("status"))
        detail = escape(str(c.get("detail") or ""))
        if c.get("hint"):
            detail += f'<div class="hint">what to do: {escape(str(c["hint"]))}</div>'
        out.append(
            f'<tr class="check {escape(status)}"><td>{escape(str(c.get("tier")))}</td>'
            f'<td>{escape(str(c.get("name")))}</td>'
            f'<td>{escape(", ".join(str(n) for n in c.get("nodes") or []))}</td>'
            f'<td class="status"><span class="{escape(status)}">{escape(status)}</span></td>'
            f'<td>{escape(str(c.get("measured") or ""))}</td>'
            f'<td>{escape(str(c.get("expected") or ""))}</td><td>{detail}</td></tr>')
    out.append("</tbody></table></section>")
    return out


def _bandwidth(section: Mapping[str, Any]) -> list[str]:
    rows = [r for r in section.get("allreduce") or [] if isinstance(r, Mapping)]
    pairs = section.get("pairs")
    if not rows and not isinstance(pairs, Mapping):
        return []
    out = ['<section id="bandwidth"><h2>Bandwidth</h2>']
    out.extend(_busbw_chart(rows, section.get("expected")))
    if isinstance(pairs, Mapping) and pairs.get("nodes"):
        out.extend(_pairs_chart(pairs))
    out.append("</section>")
    return out


def _expected_band(expected: Any, sizes: list[float]) -> svg.Band | None:
    """The floor's band across the sweep's sizes, when the section has one."""
    if not isinstance(expected, Mapping) or not sizes:
        return None
    floor, warn = _number(expected.get("floor_GBps")), _number(expected.get("warn_below_GBps"))
    if floor is None:
        return None
    low = warn if warn is not None else floor * 0.5
    return svg.Band(f"expected: floor {floor:.3g} GB/s (warn below {low:.3g})",
                    [(sizes[0], low, floor), (sizes[-1], low, floor)])


def _busbw_chart(rows: list[Mapping[str, Any]], expected: Any) -> list[str]:
    """busbw against message size, one line per backend, inside the expected band."""
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        size, busbw = _number(row.get("size_bytes")), _number(row.get("busbw_GBps"))
        if size and busbw is not None and size > 0:
            series.setdefault(str(row.get("backend") or "all_reduce"), []).append((size, busbw))
    if not series:
        return []
    band = _expected_band(expected, sorted({s for points in series.values() for s, _ in points}))
    lines = [svg.Series(name, sorted(points), svg.PALETTE[i % len(svg.PALETTE)], dots=True,
                        data={"series": name})
             for i, (name, points) in enumerate(series.items())]
    out = [svg.line_chart(lines, chart_id="busbw", title="all_reduce bus bandwidth "
                          "against message size", x_label="message size",
                          y_label="busbw (GB/s)", log_x=True, log_base=2, band=band,
                          x_format=svg.size_bytes, y_zero=True)]
    if band is None:
        out.append('<p class="sub">No expected band: the inventory gives no floor for '
                   "this link (see the all_reduce rows).</p>")
    return out


def _pairs_chart(pairs: Mapping[str, Any]) -> list[str]:
    """The node-by-node matrix, and which nodes and links were blamed."""
    names = [str(n) for n in pairs["nodes"]]
    values = [[_number(v) for v in row] for row in pairs.get("GBps") or []]
    size = _number(pairs.get("bytes"))
    title = "point-to-point bandwidth between nodes (GB/s, row sends to column)"
    out = [svg.heatmap(names, names, values, chart_id="pairs", title=title,
                       value_format=lambda v: f"{v:.3g}")]
    notes = []
    if size:
        notes.append(f"{svg.size_bytes(size)} per transfer")
    if pairs.get("blamed_nodes"):
        notes.append("slow node(s): " + ", ".join(str(n) for n in pairs["blamed_nodes"]))
    if pairs.get("blamed_links"):
        notes.append("slow link(s): " + ", ".join(
            " <-> ".join(str(n) for n in link) for link in pairs["blamed_links"]))
    if notes:
        out.append(f'<p class="sub">{escape("; ".join(notes))}</p>')
    return out
