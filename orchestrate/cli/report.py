"""``orchestrate report JOB [-o FILE]``, and the pace parts of ``orchestrate status``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from orchestrate.cli import completion
from orchestrate.run.store import JobRecord, Store


@click.command()
@click.argument("job_ref", metavar="JOB", shell_complete=completion.jobs)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="write the HTML here instead of <run dir>/report.html")
def report(job_ref: str, output: Path | None) -> None:
    """Write a job's self-contained HTML report: plan, loss, per-rank time split with the
    straggler, phase timeline, doctor bandwidth. Opens offline."""
    from orchestrate.backends import get_backend
    from orchestrate.core.errors import UserError
    from orchestrate.report.runfiles import write_report

    store = Store()
    job = store.resolve(job_ref)
    if not job.terminal:
        job = get_backend(job.backend).refresh(job, store)
        job = store.get(job.id) or job
    run_dir = Path(job.run_dir)
    if not run_dir.is_dir():
        raise UserError.single(f"the run directory of job {job.id} is gone", field="JOB",
                               got=str(run_dir), hint="reports are made from the run directory")
    try:
        path = write_report(run_dir, job.to_json(), output)
    except OSError as exc:
        raise UserError.single(f"cannot write the report: {exc.strerror or exc}",
                               field="--output", got=str(output or run_dir),
                               hint="choose a writable file with -o FILE") from None
    click.echo(str(path))


def status_json(job: JobRecord) -> dict[str, Any]:
    """``status --json``: the job record with ``straggler`` and per-rank ``timing`` (over the
    whole run once the job ended, over the last 30 s of timing while it runs), and
    ``batch_shares`` under a global batch split (orchestrate/report/balance.py), and
    ``older_resumes``: the trainer's starts that passed over newer checkpoints not whole."""
    from orchestrate.cli.live import RECENT_S
    from orchestrate.report.balance import balance
    from orchestrate.report.runfiles import add_pace, read_metrics, read_timing
    from orchestrate.run.attemptmetrics import older_resumes

    run_dir = Path(job.run_dir)
    status = add_pace(job.to_json(), run_dir, None if job.terminal else RECENT_S)
    split = balance(read_metrics(run_dir), read_timing(run_dir))
    status["batch_shares"] = None if split is None else split.to_json()
    status["older_resumes"] = older_resumes(run_dir)
    return status


def status_lines(job: JobRecord) -> list[str]:
    """The straggler sentence and the loss sparkline for the text ``status``."""
    from orchestrate.cli.live import RECENT_S, loss_line, straggler_line
    from orchestrate.report.balance import balance
    from orchestrate.report.runfiles import losses, read_metrics, read_timing, run_pace
    from orchestrate.run.attemptmetrics import older_resumes

    run_dir = Path(job.run_dir)
    figures = run_pace(run_dir, {r.rank: r.node for r in job.ranks},
                       None if job.terminal else RECENT_S)
    records = read_metrics(run_dir)
    split = balance(records, read_timing(run_dir))
    lines = [straggler_line(figures.straggler, figures), loss_line(losses(records)),
             None if split is None else split.line(), *older_resumes(run_dir)]
    return [line for line in lines if line]


def watch_job(store: Store, job: JobRecord, *, limit_s: float | None = None) -> None:
    """The live view of ``status --watch`` until the job ends or Ctrl-C."""
    from orchestrate.backends import get_backend
    from orchestrate.cli.live import RECENT_S, Snapshot, activity, progress_time, watch
    from orchestrate.cli.tables import console
    from orchestrate.diagnosis.evidence import read_heartbeats
    from orchestrate.report.runfiles import losses, read_metrics, run_pace

    backend = get_backend(job.backend)
    run_dir = Path(job.run_dir)

    def take() -> Snapshot:
        current = store.get(job.id) or job
        if not current.terminal:
            current = backend.refresh(current, store)
            current = store.get(current.id) or current
        status = current.to_json()
        records = read_metrics(run_dir)
        last = next((r for r in reversed(records) if r.kind in ("step", "epoch")), None)
        nodes = {r.rank: r.node for r in current.ranks}
        beats = read_heartbeats(run_dir, sorted(nodes))
        return Snapshot(
            status=status,
            pace=run_pace(run_dir, nodes, None if current.terminal else RECENT_S),
            losses=losses(records),
            last_metrics=last,
            heartbeats={rank: progress_time(b) for rank, b in beats.items()},
            now=time.time(),
            shares=next((r.batch_shares for r in reversed(records) if r.batch_shares), ()),
            activity={rank: text for rank, b in beats.items() if (text := activity(b))},
        )

    watch(take, console(), limit_s=limit_s)
