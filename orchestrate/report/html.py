"""The run report: one self-contained HTML file that shows a run instead of describing it.

:func:`render_report` turns a :class:`~orchestrate.report.rundata.RunData` (read from a run
directory by :func:`orchestrate.report.runfiles.load_run`) into HTML text: inline CSS and inline
SVG charts from :mod:`orchestrate.report.svg`, no script, font, stylesheet or image from anywhere
else, so the file opens offline, prints, and can be attached to an issue. Hover text comes from
SVG ``<title>`` elements; there is no JavaScript at all. Pure: values in, text out; the time the
report was written is part of the input.

What it shows, each part only when its data exist:

1. the job: state, reason, times, and a one-line verdict on the pace (the straggler);
2. the plan: nodes (address, ranks, GPUs), the rank table, the environment the ranks get, the
   training settings;
3. loss and validation metrics against step, with restart and stall markers;
4. per-rank time split per step (data / compute / sync, see :mod:`orchestrate.report.straggler`)
   with the straggler highlighted and its gap in %, and each rank's own work over the run;
5. a timeline of the job's phases: submitted, started, first step, checkpoints, stalls,
   restarts (attempts), end;
6. the doctor's bandwidth charts when the job has a doctor result
   (:mod:`orchestrate.report.bandwidth`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from orchestrate.core.metricrecord import MetricRecord, finite
from orchestrate.core.plan.plan import Plan
from orchestrate.report import svg
from orchestrate.report.balance import balance
from orchestrate.report.bandwidth import bandwidth_section
from orchestrate.report.rundata import (
    RunData,
    effective_metrics,
    metric_points,
    rank_nodes,
    restarts,
    step_at,
)
from orchestrate.report.straggler import MATERIAL_GAP_PCT, Pace, pace, series


def _clock(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _duration(start: float | None, end: float | None) -> str:
    if start is None or end is None:
        return "-"
    return svg.seconds(end - start)


# --- HTML ----------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;margin:0;
background:#f6f7f9}
main{max-width:980px;margin:0 auto;padding:20px 24px 48px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid
#dde1e6;padding-bottom:4px}
.sub{color:#5a6470;margin:0 0 10px}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:6px;padding:12px 14px;margin:10px 0}
.state{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;
color:#fff;background:#6a737d;vertical-align:middle}
.state.COMPLETED{background:#2e7d32}.state.FAILED,.state.NODE_FAIL,.state.OUT_OF_MEMORY,
.state.TIMEOUT{background:#c62828}.state.RUNNING{background:#1565c0}
.verdict{font-size:15px}.verdict.bad{color:#b71c1c;font-weight:600}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid #eceef1;padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#5a6470;font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
tr.straggler td{color:#c62828;font-weight:600}
pre.lines{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;background:#f1f3f5;padding:6px;
overflow-x:auto;white-space:pre-wrap;margin:0 0 10px}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;background:#f1f3f5;padding:0 3px;
border-radius:3px}
svg.chart{width:100%;height:auto;background:#fff;border:1px solid #e1e4e8;border-radius:6px;
margin:8px 0}
svg.chart.heatmap{width:auto;max-width:100%}
.note{color:#5a6470;font-size:12.5px}
ul.stalls li{margin:4px 0}
footer{color:#8a939c;font-size:12px;margin-top:36px}
"""


def render_report(data: RunData) -> str:
    """The whole report as one HTML document."""
    job = data.job or {}
    nodes = rank_nodes(data.plan)
    if not nodes:
        nodes = {int(r["rank"]): str(r.get("node", "?")) for r in job.get("ranks") or []
                 if isinstance(r, Mapping) and isinstance(r.get("rank"), int)}
    figures = pace(data.timing, nodes)
    metrics = effective_metrics(data.metrics)
    name = str(job.get("name") or (data.plan.job_name if data.plan else "") or data.job_id)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(data.job_id)} - orchestrate report</title>",
        f"<style>{_CSS}</style></head><body><main>",
        *_header(data, name, figures, metrics),
        *_plan_section(data),
        *_metrics_section(data, metrics),
        *_pace_section(data, figures),
        *_timeline_section(data, metrics),
        *bandwidth_section(data.doctor),
        f'<footer>orchestrate report for {escape(data.job_id)}'
        + (f", written {escape(_clock(data.generated_at))}" if data.generated_at else "")
        + ". Self-contained: no scripts, fonts or network.</footer>",
        "</main></body></html>",
        "",
    ]
    return "\n".join(parts)


def _header(data: RunData, name: str, figures: Pace, metrics: Sequence[MetricRecord]
            ) -> list[str]:
    job = data.job or {}
    plan = data.plan
    state = str(job.get("state") or "")
    out = [f'<header><h1>{escape(data.job_id)} '
           + (f'<span class="state {escape(state)}">{escape(state)}</span>' if state else "")
           + "</h1>"]
    world = (plan.world_size if plan else None) or job.get("world_size")
    backend = (plan.backend if plan else None) or job.get("backend")
    bits = [f"job {escape(name)}"]
    if backend:
        bits.append(f"{escape(str(backend))} backend")
    if world:
        bits.append(f"{escape(str(world))} ranks on {(len(plan.nodes) if plan else 0) or '?'} "
                    f"node(s)")
    if plan is not None and plan.dist_backend:
        bits.append(escape(plan.dist_backend))
    out.append(f'<p class="sub">{" · ".join(bits)}</p>')
    if job.get("reason"):
        out.append(f'<p class="sub">reason: {escape(str(job["reason"]))}</p>')
    out.extend(_failure_lines(job.get("failure")))
    out.append('<div class="card"><table class="facts">'
               + "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>"
                         for k, v in _facts(job, metrics, data.timing))
               + "</table>")
    out.append(_verdict(figures))
    for stall in data.stalls:
        out.append(f'<p class="verdict bad">stall ({escape(stall.kind)}): '
                   f"{escape(stall.summary)}</p>")
    out.append("</div></header>")
    return out


def _failure_lines(failure: Any) -> list[str]:
    """The failed rank's last lines (the rank the reason names: the one that explained it)."""
    if not isinstance(failure, Mapping) or not failure.get("last_lines"):
        return []
    lines = "\n".join(escape(str(line)) for line in failure["last_lines"])
    return [f'<p class="sub" id="failure" data-rank="{escape(str(failure.get("rank")))}">'
            f'last lines of rank {escape(str(failure.get("rank")))} '
            f'({escape(str(failure.get("node")))}):</p><pre class="lines">{lines}</pre>']


def _facts(job: Mapping[str, Any], metrics: Sequence[MetricRecord],
           timing: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[tuple[str, str]]:
    """The job's facts table: times, steps, the last epoch's figures."""
    rows = [
        ("submitted", _clock(finite(job.get("submitted_at")))),
        ("ran for", _duration(finite(job.get("started_at")), finite(job.get("finished_at")))),
    ]
    last_epoch = next((r for r in reversed(metrics) if r.kind == "epoch"), None)
    last_step = max((r.step for r in metrics if r.step is not None), default=None)
    if last_step is not None:
        rows.append(("steps", str(last_step)))
    if last_epoch is not None:
        for key, value in (("train_loss", last_epoch.train_loss),
                           ("val_loss", last_epoch.val_loss),
                           ("val_accuracy", last_epoch.val_accuracy),
                           ("samples_per_s", last_epoch.samples_per_s)):
            if value is not None:
                rows.append((f"last {key}", f"{value:.4g}"))
    return rows + _split_rows(metrics, last_epoch, timing)


def _split_rows(metrics: Sequence[MetricRecord], last_epoch: MetricRecord | None,
                timing: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[tuple[str, str]]:
    """Each rank's share of the global batch (the last in force, and what measuring changed)
    and measured peak memory."""
    rows = []
    split = balance(metrics, timing)
    if split is not None:
        rows.append(("batch shares", f"{', '.join(map(str, split.now))} (of {sum(split.now)})"))
        if split.changed_at is not None:
            rows.append(("batch shares at the start",
                         f"{', '.join(map(str, split.first))} (measured shares from step "
                         f"{split.changed_at})"))
        if split.step_s_before is not None and split.step_s_after is not None:
            rows.append(("step time before / after balancing",
                         f"{split.step_s_before * 1e3:.0f} ms / {split.step_s_after * 1e3:.0f} ms"))
    if last_epoch is not None and last_epoch.peak_memory_gb:
        rows.append(("peak memory GB by rank",
                     ", ".join(f"{v:.3g}" for v in last_epoch.peak_memory_gb)))
    return rows


def _verdict(figures: Pace) -> str:
    if not figures.ranks:
        return '<p class="verdict">no per-rank step timing (ranks other than orchestrate.train ' \
               "programs do not write it)</p>"
    s = figures.straggler
    if s is None:
        slowest = figures.by_rank().get(figures.slowest) if figures.slowest is not None else None
        gap = f" (slowest: rank {slowest.rank}, {slowest.gap_pct:+.1f}%)" if slowest else ""
        return (f'<p class="verdict">no straggler: every rank\'s own work per step is within '
                f"{MATERIAL_GAP_PCT:.0f}% of the others'{escape(gap)}</p>")
    return (f'<p class="verdict bad" id="straggler" data-rank="{s.rank}">straggler: rank '
            f"{s.rank} on {escape(s.node)}: its own work per step (data + compute) is "
            f"{s.gap_pct:.0f}% longer than the other ranks'; they wait for it in the gradient "
            "all-reduce</p>")


def _plan_section(data: RunData) -> list[str]:
    plan = data.plan
    if plan is None:
        return []
    out = ["<section id=\"plan\"><h2>Plan</h2>"]
    node_rows = []
    for n in plan.nodes:
        ranks = f"{n.first_rank}-{n.last_rank}" if n.nproc > 1 else str(n.first_rank)
        gpus = ", ".join(f"{i}: {m}" for i, m in zip(n.gpu_indices, n.gpu_models, strict=False))
        node_env = " ".join(f"{k}={v}" for k, v in sorted(n.env.items()))
        node_rows.append(
            f"<tr><td>{escape(n.name)}</td><td>{escape(n.address)}</td>"
            f"<td>{escape(ranks)}</td><td>{escape(gpus or 'CPU processes')}</td>"
            f"<td><code>{escape(node_env)}</code></td></tr>"
        )
    out.append('<div class="card"><table class="nodes"><tr><th>node</th><th>address</th>'
               "<th>ranks</th><th>GPUs (CUDA index: model)</th><th>node env</th></tr>"
               + "".join(node_rows) + "</table>")
    if plan.ranks and len(plan.ranks) <= 64:
        out.append('<table class="ranks"><tr><th>rank</th><th>node</th><th>local rank</th>'
                   "<th>GPU</th></tr>" + "".join(
                       f"<tr><td>{r.rank}</td><td>{escape(r.node)}</td>"
                       f"<td>{r.local_rank}</td><td>"
                       + escape(f"{r.gpu_index}: {r.gpu_model}"
                                if r.gpu_index is not None else "-")
                       + "</td></tr>" for r in plan.ranks) + "</table>")
    out.extend(_run_settings(plan, data.train))
    out.append("</div></section>")
    return out


def _run_settings(plan: Plan, train: Mapping[str, Any] | None) -> list[str]:
    """The environment every rank gets, the command, the training settings, the warnings."""
    out = []
    if plan.env:
        out.append('<table class="env"><tr><th>environment of every rank</th><th></th></tr>'
                   + "".join(f"<tr><td><code>{escape(k)}</code></td><td><code>{escape(str(v))}"
                             "</code></td></tr>" for k, v in sorted(plan.env.items()))
                   + "</table>")
    if plan.secret_env:
        out.append(f'<p class="note">secret variables (values never written): '
                   f"{escape(', '.join(plan.secret_env))}</p>")
    if plan.command:
        out.append(f"<p>command: <code>{escape(' '.join(plan.command))}</code></p>")
    if train:
        keys = ("model", "dataset", "epochs", "max_steps", "batch_size", "grad_accum_steps",
                "precision", "optimizer", "num_workers", "seed")
        shown = [(k, train[k]) for k in keys if train.get(k) is not None]
        out.append('<table class="train"><tr><th>training setting</th><th></th></tr>' + "".join(
            f"<tr><td>{escape(k)}</td><td><code>{escape(_short(v))}</code></td></tr>"
            for k, v in shown) + "</table>")
    for warning in plan.warnings:
        out.append(f'<p class="note">planner warning: {escape(warning)}</p>')
    return out


def _short(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _metrics_section(data: RunData, metrics: Sequence[MetricRecord]) -> list[str]:
    markers = [svg.Marker(step, label, "restart", "#6a1b9a") for step, label in restarts(data)]
    for stall in data.stalls:
        # All records, the dead attempt's too: a stall is placed at the step it happened in.
        step = step_at(data.metrics, stall.at)
        if step is not None:
            markers.append(svg.Marker(step, f"stall: {stall.kind}", "stall", svg.HIGHLIGHT))
    step_loss = metric_points(metrics, "step", lambda r: r.train_loss)
    epoch_train = metric_points(metrics, "epoch", lambda r: r.train_loss)
    epoch_val = metric_points(metrics, "epoch", lambda r: r.val_loss)
    loss_series = []
    if step_loss:
        loss_series.append(svg.Series("train_loss (logged steps)", step_loss, svg.MUTED,
                                      width=1.0))
    if epoch_train:
        loss_series.append(svg.Series("train_loss (epoch)", epoch_train, svg.PALETTE[0],
                                      dots=True, data={"kind": "epoch"}))
    if epoch_val:
        loss_series.append(svg.Series("val_loss", epoch_val, svg.PALETTE[1], dots=True,
                                      data={"kind": "epoch"}))
    if not loss_series:
        return ['<section id="metrics"><h2>Loss</h2><p class="note">no metrics.jsonl records '
                "with a loss yet</p></section>"]
    out = ['<section id="metrics"><h2>Loss and validation</h2>',
           svg.line_chart(loss_series, chart_id="loss", title="loss against optimizer step",
                          x_label="optimizer step", y_label="loss", markers=markers)]
    accuracy = metric_points(metrics, "epoch", lambda r: r.val_accuracy)
    if accuracy:
        out.append(svg.line_chart(
            [svg.Series("val_accuracy", accuracy, svg.PALETTE[2], dots=True,
                        data={"kind": "epoch"})],
            chart_id="accuracy", title="validation accuracy against optimizer step",
            x_label="optimizer step", y_label="accuracy", markers=markers,
            canvas=svg.Canvas(height=200)))
    out.append("</section>")
    return out


_PARTS = (("data", "#e69f00"), ("compute", "#0072b2"), ("sync wait", "#b8c2cc"))


def _pace_section(data: RunData, figures: Pace) -> list[str]:
    if not figures.ranks:
        return []
    straggler = figures.straggler.rank if figures.straggler else None
    gpus = {r.rank: r.gpu_model for r in data.plan.ranks} if data.plan else {}
    bars = []
    for r in figures.ranks:
        is_straggler = r.rank == straggler
        note = f"{r.gap_pct:+.0f}%" + (" straggler" if is_straggler else "")
        where = r.node + (f" {gpus[r.rank]}" if gpus.get(r.rank) else "")
        bars.append(svg.Bar(
            f"rank {r.rank} ({where})", (r.data_s, r.compute_s, r.sync_s), note=note,
            highlight=is_straggler,
            data={"rank": str(r.rank), "gap": f"{r.gap_pct:.1f}"},
        ))
    out = ['<section id="pace"><h2>Per-rank time per step</h2>',
           '<p class="note">Own work = data (waiting for the batch) + compute (forward, the '
           "backward pass every rank needs, optimizer); sync wait = time in the gradient "
           "all-reduce waiting for slower ranks. Under DDP every rank takes the same steps per "
           "second: the straggler is the rank whose own work is longest, and the others show "
           "its gap as sync wait. Gap: own work against the median of the other ranks.</p>",
           svg.stacked_bars(bars, _PARTS, chart_id="split", title="time per optimizer step",
                            x_label="per step", value_format=svg.milliseconds)]
    lines = _own_work_lines(data.timing, straggler)
    if lines:
        out.append(svg.line_chart(
            lines, chart_id="pace-over-time",
            title="data + forward + optimizer per step, each rank, over the run",
            x_label="optimizer step", y_label="per step", y_format=svg.milliseconds,
            y_zero=True, canvas=svg.Canvas(height=240),
            max_points=max(150, 3000 // len(lines))))
    out.extend(_pace_table(figures, straggler))
    out.append("</section>")
    return out


def _own_work_lines(timing: Mapping[int, Sequence[Mapping[str, Any]]], straggler: int | None
                    ) -> list[svg.Series]:
    """Each rank's own work per step over the run; the straggler's line last (drawn on top)."""
    lines = []
    palette_index = 0
    for rank in sorted(timing):
        own = [(float(p.step), p.outside_backward_s) for p in series(timing[rank])]
        if not own:
            continue
        if rank == straggler:
            color, width = svg.HIGHLIGHT, 2.4
        elif len(timing) > 8:
            color, width = svg.MUTED, 1.0
        else:
            color, width = svg.PALETTE[(palette_index + 4) % len(svg.PALETTE)], 1.4
            palette_index += 1
        lines.append(svg.Series(f"rank {rank}", own, color, width=width,
                                data={"rank": str(rank),
                                      "straggler": "1" if rank == straggler else "0"}))
    lines.sort(key=lambda s: s.data.get("straggler") == "1")
    return lines


def _pace_table(figures: Pace, straggler: int | None) -> list[str]:
    heads = ("steps/s", "samples/s", "data", "forward", "backward+sync", "optimizer",
             "sync wait", "gap")
    out = ['<table class="pace"><tr><th>rank</th><th>node</th>'
           + "".join(f'<th class="num">{h}</th>' for h in heads) + "</tr>"]
    for r in figures.ranks:
        cls = ' class="straggler"' if r.rank == straggler else ""
        cells = [f"{r.steps_per_s:.1f}", f"{r.samples_per_s:.0f}",
                 *(svg.milliseconds(v) for v in (r.data_s, r.forward_s, r.backward_s,
                                                 r.optimizer_s, r.sync_s)),
                 f"{r.gap_pct:+.1f}%"]
        out.append(f'<tr{cls} data-rank="{r.rank}"><td>{r.rank}</td><td>{escape(r.node)}</td>'
                   + "".join(f'<td class="num">{escape(c)}</td>' for c in cells) + "</tr>")
    out.append("</table>")
    return out


def _timeline_section(data: RunData, metrics: Sequence[MetricRecord]) -> list[str]:
    job = data.job or {}
    submitted = finite(job.get("submitted_at"))
    started = finite(job.get("started_at"))
    first_step = finite(job.get("first_step_at"))
    finished = finite(job.get("finished_at"))
    if first_step is None:
        first_step = next((r.time for r in metrics if r.kind == "start" and r.time is not None),
                          None)
    times = [t for t in (submitted, started, first_step, finished) if t is not None]
    times += [r.time for r in metrics if r.time is not None]
    if not times:
        return []
    origin = submitted if submitted is not None else min(times)
    end = finished if finished is not None else max(times)
    spans, events = _attempt_marks(data, started, first_step, end)
    state = str(job.get("state") or "end")
    for t, label, kind in ((submitted, "submitted", "submitted"), (started, "started", "started"),
                           (first_step, "first step", "first-step"),
                           (finished, state.lower(), "end")):
        if t is not None:
            events.append(svg.Event(t, label, kind, svg.INK, row="job", caption=label))
    events += _metric_events(metrics, restarted=len(data.attempts) > 1)
    events += [svg.Event(s.at, f"stall ({s.kind}): {s.summary}", "stall", svg.HIGHLIGHT,
                         row="stalls") for s in data.stalls]
    out = ['<section id="timeline"><h2>Timeline</h2>',
           svg.timeline(spans, events, chart_id="phases", title="phases of the job",
                        origin=origin)]
    if data.stalls:
        out.append('<ul class="stalls">' + "".join(
            f"<li><b>{escape(s.kind)}</b> at {escape(_clock(s.at))}: {escape(s.summary)}</li>"
            for s in data.stalls) + "</ul>")
    out.append("</section>")
    return out


def _attempt_marks(data: RunData, started: float | None, first_step: float | None, end: float
                   ) -> tuple[list[svg.Span], list[svg.Event]]:
    """The ranks' row: each attempt of a restarted job (and its restart), else the one run as
    starting / training."""
    spans: list[svg.Span] = []
    events: list[svg.Event] = []
    if len(data.attempts) > 1:
        for a in data.attempts:
            label = f"attempt {a.n}" + (f" ({a.reason})" if a.reason else "")
            spans.append(svg.Span(a.started, a.ended if a.ended is not None else end, label,
                                  "attempt", svg.PALETTE[0] if a.n % 2 else svg.PALETTE[4],
                                  row="ranks"))
            if a.n > 1:
                events.append(svg.Event(a.started, f"restart {a.n}"
                                        + (f" from step {a.resumed_from_step}"
                                           if a.resumed_from_step is not None else ""),
                                        "restart", "#6a1b9a", row="restarts"))
    elif started is not None:
        if first_step is not None and first_step > started:
            spans.append(svg.Span(started, first_step, "starting", "starting", svg.MUTED,
                                  row="ranks"))
            spans.append(svg.Span(first_step, end, "training", "training", svg.PALETTE[0],
                                  row="ranks"))
        else:
            spans.append(svg.Span(started, end, "running", "running", svg.PALETTE[0],
                                  row="ranks"))
    return spans, events


def _metric_events(metrics: Sequence[MetricRecord], *, restarted: bool) -> list[svg.Event]:
    """Checkpoints, epochs and (without attempts to show them) restarts, from the metrics."""
    events = []
    for r in metrics:
        if r.time is None:
            continue
        if r.kind == "checkpoint":
            events.append(svg.Event(r.time, f"checkpoint at step {r.step}", "checkpoint",
                                    svg.PALETTE[2], row="checkpoints"))
        elif r.kind == "epoch":
            events.append(svg.Event(r.time, f"epoch {r.epoch} (step {r.step})",
                                    "epoch", svg.PALETTE[1], row="epochs"))
        elif r.kind == "start" and r.resumed_from_step is not None and not restarted:
            events.append(svg.Event(r.time, f"restart: resumed from step {r.resumed_from_step}",
                                    "restart", "#6a1b9a", row="restarts"))
    return events
