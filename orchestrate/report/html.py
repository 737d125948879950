"""The run report: one self-contained HTML file that shows a run instead of describing it.

:func:`render_report` turns a :class:`RunData` (read from a run directory by
:func:`orchestrate.report.runfiles.load_run`) into HTML text: inline CSS and inline SVG charts from
:mod:`orchestrate.report.svg`, no script, font, stylesheet or image from anywhere else, so the file
opens offline, prints, and can be attached to an issue. Hover text comes from SVG ``<title>``
elements; there is no JavaScript at all. Pure: values in, text out; the time the report was
written is part of the input.

What it shows, each part only when its data exist:

1. the job: state, reason, times, and a one-line verdict on the pace (the straggler);
2. the plan: nodes (address, ranks, GPUs), the rank table, the environment the ranks get, the
   training settings;
3. loss and validation metrics against step, with restart and stall markers;
4. per-rank time split per step (data / compute / sync, see :mod:`orchestrate.report.straggler`)
with
   the straggler highlighted and its gap in %, and each rank's own work over the run;
5. a timeline of the job's phases: submitted, started, first step, checkpoints, stalls,
   restarts (attempts), end;
6. the doctor's bandwidth charts when the job has a doctor result: busbw against message size
   (log x) with the expected band, and the node-by-node bandwidth matrix.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from orchestrate.report import svg
from orchestrate.report.straggler import MATERIAL_GAP_PCT, Pace, pace, series


@dataclass(frozen=True)
class Stall:
    """A stall the stall watch diagnosed (``diag/diagnosis.json``)."""

    kind: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    summary: str
    at: float | None


@dataclass(frozen=True)
class Attempt:
    """One run of the job's ranks; a restart starts attempt ``n`` + 1."""

    n: int
    started: float | None
    ended: float | None
    reason: str
    resumed_from_step: int | None


@dataclass(frozen=True)
class RunData:
    """Everything the report shows, as read from a run directory (missing parts are empty)."""

    job_id: str
    plan: Mapping[str, Any] = field(default_factory=dict)
    job: Mapping[str, Any] | None = None  # JobRecord.to_json() when known
    train: Mapping[str, Any] | None = None  # train.json (TrainSpec) for train: jobs
    metrics: Sequence[Mapping[str, Any]] = ()
    timing: Mapping[int, Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    stalls: Sequence[Stall] = ()
    attempts: Sequence[Attempt] = ()
    doctor: Mapping[str, Any] | None = None
    generated_at: float | None = None


# --- derived values ----------------------------------------------------------------------------


def rank_nodes(plan: Mapping[str, Any]) -> dict[int, str]:
    """Each rank's node name from a plan's JSON (``Plan.to_json``)."""
    nodes: dict[int, str] = {}
    for r in plan.get("ranks") or []:
        if isinstance(r, Mapping) and isinstance(r.get("rank"), int):
            nodes[r["rank"]] = str(r.get("node", "?"))
    return nodes


def _float(value: Any) -> float | None:
    if type(value) is float:  # the common case, fast
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def effective_metrics(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The metrics records that describe the run's final history: after a restart resumed
    from step S, the records of steps after S from the attempt that died are dropped (the
    resumed attempt redid those steps)."""
    kept: list[Mapping[str, Any]] = []
    for record in records:
        resumed = record.get("resumed_from_step")
        if record.get("kind") == "start" and isinstance(resumed, int):
            kept = [r for r in kept if (_float(r.get("step")) or 0) <= resumed
                    or r.get("kind") == "start"]
        kept.append(record)
    return kept


def metric_points(records: Sequence[Mapping[str, Any]], kind: str, key: str
                  ) -> list[tuple[float, float]]:
    """(step, value) of every ``kind`` record that has a number under ``key``."""
    points = []
    for r in records:
        if r.get("kind") != kind:
            continue
        step, value = r.get("step"), r.get(key)
        if type(step) is int and type(value) is float and math.isfinite(value):
            points.append((float(step), value))  # the trainer's records: the common case
            continue
        fstep, fvalue = _float(step), _float(value)
        if fstep is not None and fvalue is not None:
            points.append((fstep, fvalue))
    return points


def step_at(records: Sequence[Mapping[str, Any]], t: float) -> float | None:
    """The optimizer step reached at wall-clock ``t`` (linear between logged records)."""
    timed = sorted(
        (tt, s) for r in records
        if (tt := _float(r.get("time"))) is not None and (s := _float(r.get("step"))) is not None
    )
    if not timed:
        return None
    if t <= timed[0][0]:
        return timed[0][1]
    for (t0, s0), (t1, s1) in itertools.pairwise(timed):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return timed[-1][1]


def restarts(data: RunData) -> list[tuple[float, str]]:
    """(step, label) of every restart: attempts after the first, and metrics ``start`` records
    that resumed from a checkpoint."""
    found: dict[float, str] = {}
    for a in data.attempts:
        if a.n > 1 and a.resumed_from_step is not None:
            found[float(a.resumed_from_step)] = f"restart {a.n}"
    count = 1
    for r in data.metrics:
        resumed = r.get("resumed_from_step")
        if r.get("kind") == "start" and isinstance(resumed, int):
            count += 1
            found.setdefault(float(resumed), f"restart {count}")
    return sorted(found.items())


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
    plan = data.plan
    nodes = rank_nodes(plan)
    if not nodes:
        nodes = {int(r["rank"]): str(r.get("node", "?")) for r in job.get("ranks") or []
                 if isinstance(r, Mapping) and isinstance(r.get("rank"), int)}
    figures = pace(data.timing, nodes)
    metrics = effective_metrics(data.metrics)
    name = str(job.get("name") or plan.get("job_name") or data.job_id)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(data.job_id)} - orchestrate report</title>",
        f"<style>{_CSS}</style></head><body><main>",
        *_header(data, name, figures, metrics),
        *_plan_section(data, nodes),
        *_metrics_section(data, metrics),
        *_pace_section(data, figures),
        *_timeline_section(data, metrics),
        *_doctor_section(data),
        f'<footer>orchestrate report for {escape(data.job_id)}'
        + (f", written {escape(_clock(data.generated_at))}" if data.generated_at else "")
        + ". Self-contained: no scripts, fonts or network.</footer>",
        "</main></body></html>",
        "",
    ]
    return "\n".join(parts)


def _header(data: RunData, name: str, figures: Pace, metrics: Sequence[Mapping[str, Any]]
            ) -> list[str]:
    job = data.job or {}
    plan = data.plan
    state = str(job.get("state") or "")
    out = [f'<header><h1>{escape(data.job_id)} '
           + (f'<span class="state {escape(state)}">{escape(state)}</span>' if state else "")
           + "</h1>"]
    world = plan.get("world_size") or job.get("world_size")
    backend = plan.get("backend") or job.get("backend")
    bits = [f"job {escape(name)}"]
    if backend:
        bits.append(f"{escape(str(backend))} backend")
    if world:
        bits.append(f"{escape(str(world))} ranks on {len(plan.get('nodes') or []) or '?'} "
                    f"node(s)")
    if plan.get("dist_backend"):
        bits.append(escape(str(plan["dist_backend"])))
    out.append(f'<p class="sub">{" · ".join(bits)}</p>')
    if job.get("reason"):
        out.append(f'<p class="sub">reason: {escape(str(job["reason"]))}</p>')
    rows = [
        ("submitted", _clock(_float(job.get("submitted_at")))),
        ("ran for", _duration(_float(job.get("started_at")), _float(job.get("finished_at")))),
    ]
    last_epoch = next((r for r in reversed(metrics) if r.get("kind") == "epoch"), None)
    last_step = max((int(s) for r in metrics if (s := _float(r.get("step"))) is not None),
                    default=None)
    if last_step is not None:
        rows.append(("steps", str(last_step)))
    if last_epoch is not None:
        for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_s"):
            value = _float(last_epoch.get(key))
            if value is not None:
                rows.append((f"last {key}", f"{value:.4g}"))
    out.append('<div class="card"><table class="facts">'
               + "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
               + "</table>")
    out.append(_verdict(figures))
    for stall in data.stalls:
        out.append(f'<p class="verdict bad">stall ({escape(stall.kind)}): '
                   f"{escape(stall.summary)}</p>")
    out.append("</div></header>")
    return out


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


def _plan_section(data: RunData, nodes: Mapping[int, str]) -> list[str]:
    plan = data.plan
    if not plan:
        return []
    out = ["<section id=\"plan\"><h2>Plan</h2>"]
    node_rows = []
    for n in plan.get("nodes") or []:
        first, nproc = n.get("first_rank", 0), n.get("nproc", 0)
        ranks = f"{first}-{first + nproc - 1}" if nproc > 1 else str(first)
        gpus = ", ".join(f"{i}: {m}" for i, m in zip(n.get("gpu_indices") or [],
                                                     n.get("gpu_models") or [], strict=False))
        node_env = " ".join(f"{k}={v}" for k, v in sorted((n.get("env") or {}).items()))
        node_rows.append(
            f"<tr><td>{escape(str(n.get('name')))}</td><td>{escape(str(n.get('address')))}</td>"
            f"<td>{escape(ranks)}</td><td>{escape(gpus or 'CPU processes')}</td>"
            f"<td><code>{escape(node_env)}</code></td></tr>"
        )
    out.append('<div class="card"><table class="nodes"><tr><th>node</th><th>address</th>'
               "<th>ranks</th><th>GPUs (CUDA index: model)</th><th>node env</th></tr>"
               + "".join(node_rows) + "</table>")
    plan_ranks: list[Any] = plan.get("ranks") or []
    if plan_ranks and len(plan_ranks) <= 64:
        out.append('<table class="ranks"><tr><th>rank</th><th>node</th><th>local rank</th>'
                   "<th>GPU</th></tr>" + "".join(
                       f"<tr><td>{r.get('rank')}</td><td>{escape(str(r.get('node')))}</td>"
                       f"<td>{r.get('local_rank')}</td><td>"
                       + escape(f"{r.get('gpu_index')}: {r.get('gpu_model')}"
                                if r.get("gpu_index") is not None else "-")
                       + "</td></tr>" for r in plan_ranks) + "</table>")
    env = plan.get("env") or {}
    if env:
        out.append('<table class="env"><tr><th>environment of every rank</th><th></th></tr>'
                   + "".join(f"<tr><td><code>{escape(k)}</code></td><td><code>{escape(str(v))}"
                             "</code></td></tr>" for k, v in sorted(env.items())) + "</table>")
    secret = plan.get("secret_env") or []
    if secret:
        out.append(f'<p class="note">secret variables (values never written): '
                   f"{escape(', '.join(map(str, secret)))}</p>")
    command = plan.get("command") or []
    if command:
        out.append(f"<p>command: <code>{escape(' '.join(map(str, command)))}</code></p>")
    if data.train:
        keys = ("model", "dataset", "epochs", "max_steps", "batch_size", "grad_accum_steps",
                "precision", "optimizer", "num_workers", "seed")
        shown = [(k, data.train[k]) for k in keys if data.train.get(k) is not None]
        out.append('<table class="train"><tr><th>training setting</th><th></th></tr>' + "".join(
            f"<tr><td>{escape(k)}</td><td><code>{escape(_short(v))}</code></td></tr>"
            for k, v in shown) + "</table>")
    for warning in plan.get("warnings") or []:
        out.append(f'<p class="note">planner warning: {escape(str(warning))}</p>')
    out.append("</div></section>")
    return out


def _short(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _metrics_section(data: RunData, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
    markers = [svg.Marker(step, label, "restart", "#6a1b9a") for step, label in restarts(data)]
    for stall in data.stalls:
        # All records, the dead attempt's too: a stall is placed at the step it happened in.
        step = step_at(data.metrics, stall.at) if stall.at is not None else None
        if step is not None:
            markers.append(svg.Marker(step, f"stall: {stall.kind}", "stall", svg.HIGHLIGHT))
    step_loss = metric_points(metrics, "step", "train_loss")
    epoch_train = metric_points(metrics, "epoch", "train_loss")
    epoch_val = metric_points(metrics, "epoch", "val_loss")
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
    accuracy = metric_points(metrics, "epoch", "val_accuracy")
    if accuracy:
        out.append(svg.line_chart(
            [svg.Series("val_accuracy", accuracy, svg.PALETTE[2], dots=True,
                        data={"kind": "epoch"})],
            chart_id="accuracy", title="validation accuracy against optimizer step",
            x_label="optimizer step", y_label="accuracy", markers=markers,
            frame=svg.Frame(height=200)))
    out.append("</section>")
    return out


_PARTS = (("data", "#e69f00"), ("compute", "#0072b2"), ("sync wait", "#b8c2cc"))


def _pace_section(data: RunData, figures: Pace) -> list[str]:
    if not figures.ranks:
        return []
    straggler = figures.straggler.rank if figures.straggler else None
    gpus = {r.get("rank"): r.get("gpu_model") for r in data.plan.get("ranks") or []
            if isinstance(r, Mapping)}
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
    lines = []
    palette_index = 0
    for rank in sorted(data.timing):
        own = [(float(p.step), p.outside_backward_s) for p in series(data.timing[rank])]
        if not own:
            continue
        if rank == straggler:
            color, width = svg.HIGHLIGHT, 2.4
        elif len(data.timing) > 8:
            color, width = svg.MUTED, 1.0
        else:
            color, width = svg.PALETTE[(palette_index + 4) % len(svg.PALETTE)], 1.4
            palette_index += 1
        lines.append(svg.Series(f"rank {rank}", own, color, width=width,
                                data={"rank": str(rank),
                                      "straggler": "1" if rank == straggler else "0"}))
    # The straggler's line goes last so that it is drawn on top.
    lines.sort(key=lambda s: s.data.get("straggler") == "1")
    if lines:
        out.append(svg.line_chart(
            lines, chart_id="pace-over-time",
            title="data + forward + optimizer per step, each rank, over the run",
            x_label="optimizer step", y_label="per step", y_format=svg.milliseconds,
            y_zero=True, frame=svg.Frame(height=240),
            max_points=max(150, 3000 // len(lines))))
    heads = ("steps/s", "samples/s", "data", "forward", "backward+sync", "optimizer",
             "sync wait", "gap")
    out.append('<table class="pace"><tr><th>rank</th><th>node</th>'
               + "".join(f'<th class="num">{h}</th>' for h in heads) + "</tr>")
    for r in figures.ranks:
        cls = ' class="straggler"' if r.rank == straggler else ""
        cells = [f"{r.steps_per_s:.1f}", f"{r.samples_per_s:.0f}",
                 *(svg.milliseconds(v) for v in (r.data_s, r.forward_s, r.backward_s,
                                                 r.optimizer_s, r.sync_s)),
                 f"{r.gap_pct:+.1f}%"]
        out.append(f'<tr{cls} data-rank="{r.rank}"><td>{r.rank}</td><td>{escape(r.node)}</td>'
                   + "".join(f'<td class="num">{escape(c)}</td>' for c in cells) + "</tr>")
    out.append("</table></section>")
    return out


def _timeline_section(data: RunData, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
    job = data.job or {}
    submitted = _float(job.get("submitted_at"))
    started = _float(job.get("started_at"))
    first_step = _float(job.get("first_step_at"))
    finished = _float(job.get("finished_at"))
    if first_step is None:
        first_step = next((t for r in metrics if r.get("kind") == "start"
                           and (t := _float(r.get("time"))) is not None), None)
    times = [t for t in (submitted, started, first_step, finished) if t is not None]
    times += [t for r in metrics if (t := _float(r.get("time"))) is not None]
    if not times:
        return []
    origin = submitted if submitted is not None else min(times)
    end = finished if finished is not None else max(times)
    spans: list[svg.Span] = []
    events: list[svg.Event] = []
    if len(data.attempts) > 1:  # one attempt is drawn as starting / training below
        for a in data.attempts:
            if a.started is None:
                continue
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
    state = str(job.get("state") or "end")
    for t, label, kind in ((submitted, "submitted", "submitted"), (started, "started", "started"),
                           (first_step, "first step", "first-step"),
                           (finished, state.lower(), "end")):
        if t is not None:
            events.append(svg.Event(t, label, kind, svg.INK, row="job", caption=label))
    for r in metrics:
        t = _float(r.get("time"))
        if t is None:
            continue
        if r.get("kind") == "checkpoint":
            events.append(svg.Event(t, f"checkpoint at step {r.get('step')}", "checkpoint",
                                    svg.PALETTE[2], row="checkpoints"))
        elif r.get("kind") == "epoch":
            events.append(svg.Event(t, f"epoch {r.get('epoch')} (step {r.get('step')})",
                                    "epoch", svg.PALETTE[1], row="epochs"))
        elif r.get("kind") == "start" and isinstance(r.get("resumed_from_step"), int) \
                and len(data.attempts) < 2:
            events.append(svg.Event(t, f"restart: resumed from step {r['resumed_from_step']}",
                                    "restart", "#6a1b9a", row="restarts"))
    for stall in data.stalls:
        if stall.at is not None:
            events.append(svg.Event(stall.at, f"stall ({stall.kind}): {stall.summary}",
                                    "stall", svg.HIGHLIGHT, row="stalls"))
    out = ['<section id="timeline"><h2>Timeline</h2>',
           svg.timeline(spans, events, chart_id="phases", title="phases of the job",
                        origin=origin)]
    if data.stalls:
        out.append('<ul class="stalls">' + "".join(
            f"<li><b>{escape(s.kind)}</b> at {escape(_clock(s.at))}: {escape(s.summary)}</li>"
            for s in data.stalls) + "</ul>")
    out.append("</section>")
    return out


def _doctor_section(data: RunData) -> list[str]:
    doctor = data.doctor
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
        size = _float(row.get("size_bytes", row.get("bytes")))
        busbw = _float(row.get("busbw_GBps", row.get("busbw")))
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
        values = [[_float(v) for v in row] for row in matrix.get("GBps") or []]
        out.append(svg.heatmap(names, names, values, chart_id="pairs",
                               title="point-to-point bandwidth between nodes (GB/s)",
                               value_format=lambda v: f"{v:.3g}"))
    out.append("</section>")
    return out


def _band(expected: Any, sizes: Sequence[float]) -> svg.Band | None:
    if not isinstance(expected, Mapping) or not sizes:
        return None
    low, high = _float(expected.get("low_GBps")), _float(expected.get("high_GBps"))
    floor = _float(expected.get("floor_GBps"))
    if floor is not None and (low is None or high is None):
        low, high = floor * 0.5, floor
    if low is None or high is None:
        return None
    return svg.Band(f"expected {low:.3g}-{high:.3g} GB/s",
                    [(sizes[0], low, high), (sizes[-1], low, high)])
