"""The terminal view of a running job: per-rank pace, the straggler, heartbeats, the loss trend.

``orchestrate status JOB --watch`` redraws :func:`render` about once a second with rich's
``Live`` until the job ends; ``orchestrate status`` prints :func:`straggler_line` and
:func:`loss_line` once. The figures are the report's (:mod:`orchestrate.report.straggler`), over the
last :data:`RECENT_S` seconds of timing windows so that the view shows the current pace, not
the run's average. Building a view is pure (:class:`Snapshot` in, renderable out);
:func:`watch` is the loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from orchestrate.cli.interrupt import Interrupts
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.diagnosis.diagfiles import Heartbeat, pg_order
from orchestrate.report.straggler import MATERIAL_GAP_PCT, Pace, Straggler

#: The live view's figures cover the timing windows of the last this many seconds.
RECENT_S = 30.0
_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """``values`` as a line of ``width`` (at most) unicode blocks, low to high; longer series
    are averaged into ``width`` buckets. Empty input gives an empty string."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or width <= 0:
        return ""
    if len(finite) > width:
        size = len(finite) / width
        finite = [
            sum(chunk) / len(chunk)
            for b in range(width)
            if (chunk := finite[int(b * size): int((b + 1) * size)])
        ]
    low, high = min(finite), max(finite)
    if high == low:
        return _BLOCKS[len(_BLOCKS) // 2 - 1] * len(finite)
    top = len(_BLOCKS) - 1
    return "".join(_BLOCKS[round((v - low) / (high - low) * top)] for v in finite)


def straggler_line(straggler: Straggler | None, figures: Pace) -> str | None:
    """The sentence ``status`` prints about the pace, or None without timing data."""
    if not figures.ranks:
        return None
    if straggler is not None:
        return (f"straggler: rank {straggler.rank} ({straggler.node}): own work per step "
                f"{straggler.gap_pct:.0f}% longer than the other ranks'; they wait for it")
    if len(figures.ranks) < 2:
        return None
    return f"no straggler (every rank within {MATERIAL_GAP_PCT:.0f}% of the others)"


def loss_line(losses: Sequence[float], width: int = 40) -> str | None:
    """``loss ▇▅▃▂▁ 0.1234 (first 2.31)``, or None without losses."""
    if not losses:
        return None
    return f"loss {sparkline(losses, width)} {losses[-1]:.4g} (first {losses[0]:.4g})"


@dataclass(frozen=True)
class Snapshot:
    """What the live view shows at one moment."""

    status: Mapping[str, Any]  # JobRecord.to_json(): its state, reason and diagnosis too
    pace: Pace
    losses: Sequence[float] = ()
    last_metrics: MetricRecord | None = None  # the latest step or epoch record
    #: When each rank last made progress (a phase, a step, a collective), from its heartbeat:
    #: a stuck rank's sidecar still beats, but this time stays behind.
    heartbeats: Mapping[int, float | None] = field(default_factory=dict)
    now: float = 0.0
    shares: Sequence[int] = ()  # each rank's share of the global batch (global_batch_size)
    #: What each rank does, from its heartbeat (:func:`activity`): shown while no rank has
    #: timing figures (a ``command:`` job, or the first steps).
    activity: Mapping[int, str] = field(default_factory=dict)


def progress_time(beat: Heartbeat | None) -> float | None:
    """When the rank last progressed (``progress_t``; a beat without it: the beat's time)."""
    if beat is None:
        return None
    return beat.progress_t if beat.progress_t is not None else beat.t


def activity(beat: Heartbeat | None) -> str:
    """``step 41 · group 0: all_reduce #42 waiting``: a rank's phase and step and each process
    group's collective count, as its sidecar last wrote them; empty without a heartbeat."""
    if beat is None:
        return ""
    doing = beat.phase or ""
    if beat.step is not None:
        doing = f"step {beat.step}" if doing in ("", "step") else f"{doing}, step {beat.step}"
    parts = [doing]
    for group in sorted(beat.pgs or (), key=lambda g: pg_order(g.pg)):
        waiting = group.in_flight  # set only while a collective makes no progress
        if waiting is not None:
            parts.append(f"group {group.pg}: {waiting.op or 'collective'} #{waiting.seq} "
                         "waiting")
        else:
            parts.append(f"group {group.pg}: {max(group.completed, 0)} collectives done")
    return " · ".join(p for p in parts if p)


def _ms(value: float) -> str:
    return f"{value * 1000:.1f}"


def _split_bar(data: float, compute: float, sync: float, scale: float, width: int = 12) -> Text:
    text = Text()
    if scale <= 0:
        return text
    cells = [round(v / scale * width) for v in (data, compute, sync)]
    for count, style in zip(cells, ("yellow", "blue", "grey50"), strict=True):
        text.append("█" * count, style=style)
    return text


def _header(snap: Snapshot) -> Text:
    status = snap.status
    state = str(status.get("state", "?"))
    header = Text()
    header.append(f"{status.get('id')} ", style="bold")
    header.append(state, style="green" if state == "COMPLETED" else
                  "red" if state in ("FAILED", "CANCELLED", "TIMEOUT") else "cyan")
    last = snap.last_metrics
    bits = [f"{name} {value}" for name, value in
            (("epoch", last.epoch), ("step", last.step)) if value is not None] if last else []
    started, finished = status.get("started_at"), status.get("finished_at")
    if isinstance(started, int | float):
        if isinstance(finished, int | float):
            bits.append(f"ran {int(finished - started)}s")
        else:
            bits.append(f"running {int(snap.now - started)}s")
    if bits:
        header.append("  " + "  ".join(bits), style="dim")
    return header


def why_lines(status: Mapping[str, Any]) -> list[str]:
    """The job's reason, as ``status`` prints it beside the state, and the stall watch's
    diagnosis when the reason does not already say it."""
    reason = str(status.get("reason") or "")
    lines = [reason] if reason else []
    diagnosis = status.get("diagnosis")
    if isinstance(diagnosis, Mapping) and diagnosis.get("summary"):
        summary = str(diagnosis["summary"])
        if summary not in reason:
            lines.append(f"stalled ({diagnosis.get('kind', '?')}): {summary}")
    return lines


def _age(snap: Snapshot, rank: int) -> str:
    beat = snap.heartbeats.get(rank)
    return "-" if beat is None else f"{max(snap.now - beat, 0.0):.0f}s ago"


def _pace_table(snap: Snapshot) -> Table:
    """One row per rank: its pace, time split and gap, and when it last progressed."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    shares = list(snap.shares)
    batch = [("batch", "right")] if shares else []
    for column, justify in (("rank", "right"), ("node", "left"), ("state", "left"), *batch,
                            ("steps/s", "right"), ("samples/s", "right"),
                            ("data ms", "right"), ("compute ms", "right"), ("sync ms", "right"),
                            ("split", "left"), ("gap", "right"), ("progress", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    by_rank = snap.pace.by_rank()
    straggler = snap.pace.straggler.rank if snap.pace.straggler else None
    scale = max((r.data_s + r.compute_s + r.sync_s for r in snap.pace.ranks), default=0.0)
    for entry in snap.status.get("ranks") or []:
        rank = int(entry["rank"])
        r = by_rank.get(rank)
        style = "bold red" if rank == straggler else None
        share = [str(shares[rank]) if rank < len(shares) else "-"] if shares else []
        if r is None:
            table.add_row(str(rank), str(entry.get("node")), str(entry.get("state")), *share,
                          "-", "-", "-", "-", "-", "", "-", _age(snap, rank), style=style)
            continue
        table.add_row(
            str(rank), r.node, str(entry.get("state")), *share, f"{r.steps_per_s:.1f}",
            f"{r.samples_per_s:.0f}", _ms(r.data_s), _ms(r.compute_s), _ms(r.sync_s),
            _split_bar(r.data_s, r.compute_s, r.sync_s, scale), f"{r.gap_pct:+.0f}%",
            _age(snap, rank), style=style,
        )
    return table


def _activity_table(snap: Snapshot) -> Table:
    """One row per rank: what its sidecar says it does (phase, step, collectives)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column, justify in (("rank", "right"), ("node", "left"), ("state", "left"),
                            ("doing (phase, step, collectives)", "left"),
                            ("progress", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for entry in snap.status.get("ranks") or []:
        rank = int(entry["rank"])
        table.add_row(str(rank), str(entry.get("node")), str(entry.get("state")),
                      snap.activity.get(rank) or "-", _age(snap, rank))
    return table


def render(snap: Snapshot) -> RenderableType:
    """The whole view: a header, the job's reason and stall, the per-rank table (pace, or what
    each rank does while no rank has timing figures), the straggler and the loss trend."""
    lines: list[RenderableType] = [_header(snap)]
    lines.extend(Text(line, style="bold red") for line in why_lines(snap.status))
    timed = bool(snap.pace.ranks)
    lines.append(_pace_table(snap) if timed or not snap.activity else _activity_table(snap))
    straggler = snap.pace.straggler.rank if snap.pace.straggler else None
    pace_text = straggler_line(snap.pace.straggler, snap.pace)
    if pace_text:
        lines.append(Text(pace_text, style="bold red" if straggler is not None else "green"))
    trend = loss_line(snap.losses)
    if trend:
        lines.append(Text(trend))
    elif not timed and not snap.activity:
        lines.append(Text("waiting for the first steps...", style="dim"))
    lines.append(Text("split: data (yellow) / compute (blue) / sync wait (grey); progress: "
                      "since the rank's last phase, step or collective; "
                      "Ctrl-C leaves the view, not the job", style="dim"))
    return Group(*lines)


def watch(take: Callable[[], Snapshot], console: Console, *, interval_s: float = 1.0,
          limit_s: float | None = None) -> Snapshot:
    """Redraw ``take()`` every ``interval_s`` until the job has ended (or ``limit_s`` passed);
    returns the last snapshot. Ctrl-C raises :class:`KeyboardInterrupt` between two redraws
    (:class:`~orchestrate.cli.interrupt.Interrupts`), never in the middle of asking for the
    job's state: the caller leaves the view and the job runs on."""
    from rich.live import Live

    from orchestrate.run.store import TERMINAL

    with Interrupts() as interrupts:
        snap = take()
        deadline = None if limit_s is None else time.monotonic() + limit_s
        with Live(render(snap), console=console, refresh_per_second=4, transient=False) as live:
            while str(snap.status.get("state")) not in TERMINAL:
                if deadline is not None and time.monotonic() > deadline:
                    break
                _pause(interval_s, interrupts)
                snap = take()
                live.update(render(snap))
    return snap


def _pause(seconds: float, interrupts: Interrupts) -> None:
    """Sleep ``seconds``, answering Ctrl-C within a tenth of a second."""
    end = time.monotonic() + seconds
    while True:
        interrupts.check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.1))
