"""Commands that launch and track jobs: submit, list, status, logs, cancel."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from orchestrate.backends import get_backend
from orchestrate.cli import completion
from orchestrate.cli.tables import console
from orchestrate.core.errors import EXIT_BUSY, EXIT_USER_ERROR, UserError
from orchestrate.core.layout import DOCTOR_FILE, rank_log
from orchestrate.run.attemptmetrics import older_resumes
from orchestrate.run.store import JobRecord, Store

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrate.backends.early import Early
    from orchestrate.doctor.run import Run
    from orchestrate.run.prepare import Prepared


def _store() -> Store:
    return Store()


def resolve_or_latest(store: Store, job_ref: str | None) -> JobRecord:
    """The job a reference names (id, name, unique prefix), or the latest job without one."""
    if job_ref is None:
        latest = store.list(1)
        if not latest:
            raise UserError.single("no jobs yet", field="JOB",
                                   hint="submit one with `orchestrate submit JOB_FILE`")
        job_ref = latest[0].id
    return store.resolve(job_ref)


def _refreshed(store: Store, job: JobRecord) -> JobRecord:
    return get_backend(job.backend).refresh(job, store)


@click.command()
@click.argument("job_file", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
              help="override a job field (repeatable)")
@click.option("--follow/--detach", default=None,
              help="stream output until the job ends (default on a terminal; Ctrl-C then "
              "cancels the job and exits 130) or return at once")
@click.option("--dry-run", is_flag=True, help="print what would be submitted; launch nothing")
@click.option("--job-id", default=None, help="use this job id instead of a fresh one")
@click.option("--debug", is_flag=True,
              help="NCCL's log per host and process (run dir nccl/) and torch's collective "
              "checks (TORCH_DISTRIBUTED_DEBUG=DETAIL, milliseconds per collective)")
@click.option("--preflight", is_flag=True,
              help="run the doctor's static, connect and smoke tiers on the job's nodes "
              "first; submit only if no check failed")
@click.option("--wait", "wait", is_flag=False, flag_value="true", default=None,
              metavar="[=TIMEOUT]",
              help="local and SSH: when other jobs (or processes) hold what the job needs, wait "
              "for it as PENDING, first come first served, instead of exiting 75; TIMEOUT in "
              "Slurm's formats (MM, HH:MM:SS), none: no bound (resources.wait)")
def submit(job_file: Path, overrides: tuple[str, ...], follow: bool | None, dry_run: bool,
           job_id: str | None, debug: bool, preflight: bool, wait: str | None) -> None:
    """Launch a job; exits 0 when a followed job completes, 1 when it fails (or, with
    --preflight, when a check failed and nothing was submitted), 75 when it could not be
    placed now (or, waiting, within its bound), 130 when Ctrl-C cancelled a followed job."""
    if dry_run:
        return _dry_run(job_file, overrides, job_id, debug, wait)
    # The supervisor-to-be starts first and imports while this process plans (local, SSH).
    from orchestrate.backends.early import Early

    early, suffix = Early.start(job_id)
    try:
        _submit(job_file, overrides, follow, job_id, debug, preflight, wait, early, suffix)
    finally:
        if early is not None:
            early.close()


def _planned(job_file: Path, overrides: tuple[str, ...], job_id: str | None, debug: bool,
             wait: str | None, suffix: str | None) -> Prepared:
    from orchestrate.cli.progress import progress
    from orchestrate.run.prepare import new_id_suffix, prepare

    if wait is not None:
        overrides = (*overrides, "resources.wait=" + (
            "true" if wait == "true" else repr(wait)))
    with progress("planning"):  # a memory trace takes up to a minute
        return prepare(job_file, overrides, job_id=job_id, id_suffix=suffix or new_id_suffix(),
                       debug=debug)


def _dry_run(job_file: Path, overrides: tuple[str, ...], job_id: str | None, debug: bool,
             wait: str | None) -> None:
    """``submit --dry-run``: what would be submitted; nothing launched."""
    from orchestrate.core.render.render import merged

    prepared = _planned(job_file, overrides, job_id, debug, wait, None)
    backend = get_backend(prepared.plan.backend)
    click.echo(merged(backend.files(prepared.plan, prepared.templates_dir)), nl=False)
    backend.check(prepared)


def _submit(job_file: Path, overrides: tuple[str, ...], follow: bool | None,
            job_id: str | None, debug: bool, preflight: bool, wait: str | None,
            early: Early | None, suffix: str | None) -> None:
    from orchestrate.backends.detached import DetachedBackend
    from orchestrate.cli.progress import progress

    prepared = _planned(job_file, overrides, job_id, debug, wait, suffix)
    backend = get_backend(prepared.plan.backend)
    if early is not None and not isinstance(backend, DetachedBackend):
        early.close()  # a Slurm job: sbatch, no supervisor here
    for warning in prepared.plan.warnings:
        click.echo(f"warning: {warning}", err=True)
    store = _store()
    if job_id is not None and store.get(job_id) is not None:
        raise UserError.single(
            f"a job with id {job_id} exists already", field="--job-id", got=job_id,
            hint=f"`orchestrate resume {job_id}` runs it again in its run directory; "
            "or choose another id",
        )
    checked = _preflight(prepared, store) if preflight else None
    with progress("starting the job's supervisor"):  # it reports its phases and hosts
        record = backend.submit(prepared, store, early) \
            if isinstance(backend, DetachedBackend) else backend.submit(prepared, store)
    if checked is not None:
        # The report of the job shows the doctor's figures (orchestrate/report/runfiles.py).
        import shutil

        shutil.copyfile(checked.run_dir / DOCTOR_FILE, Path(record.run_dir) / DOCTOR_FILE)
    if record.state == "PENDING" and record.reason:
        click.echo(f"job {record.id} is {record.reason}", err=True)
    if follow is None:
        follow = sys.stdout.isatty()
    if not follow:
        click.echo(record.id)
        return
    click.echo(f"job {record.id} submitted ({record.backend}); run dir {record.run_dir}; "
               "Ctrl-C cancels it (`orchestrate logs -f` follows without cancelling)", err=True)
    final = _follow(store, record, cancel_on_interrupt=True)
    _summary(final)
    raise click.exceptions.Exit(_exit_status(final))


def _exit_status(job: JobRecord) -> int:
    """0 completed, 75 never placed within its wait (try again later), 2 when the rank that
    failed it exited 2 (a mistake in the job a rank found at its start: ``train.model_args``, a
    batch larger than the data; the same status ``validate`` gives the mistakes it can see),
    else 1."""
    if job.state == "COMPLETED":
        return 0
    if job.state == "FAILED" and job.failure is not None and \
            job.failure.exit.code == EXIT_USER_ERROR and job.failure.exit.signal is None:
        return EXIT_USER_ERROR
    return EXIT_BUSY if job.state == "DEADLINE" and job.started_at is None else 1


def _preflight(prepared: Prepared, store: Store) -> Run:
    """The doctor's static, connect and smoke tiers on the job's nodes, through its backend;
    refuses (exit 1) when a check failed."""
    from orchestrate.cli.doctor import report
    from orchestrate.cli.progress import progress
    from orchestrate.doctor import run as doctor

    with progress("preflight: the doctor's static, connect and smoke tiers"):
        run = doctor.run(prepared, doctor.Settings(tier="smoke"), store=store)
    report(run, stderr=True)
    if run.exit_status:
        click.echo(f"preflight failed: {doctor.names(run.failed())}; job not submitted", err=True)
        raise click.exceptions.Exit(1)
    return run


def _follow(store: Store, record: JobRecord, path: Path | None = None, *,
            cancel_on_interrupt: bool = False) -> JobRecord:
    """Follow the job until it ends. Ctrl-C leaves the view (exit 130) and the job runs on;
    with ``cancel_on_interrupt`` (``submit``/``resume --follow``, which say so first) it cancels
    the job, then exits 130."""
    from orchestrate.backends.handshake import end_signal
    from orchestrate.cli.follow import follow
    from orchestrate.cli.interrupt import EXIT_INTERRUPTED, ignoring_interrupts, leave_view

    backend = get_backend(record.backend)
    try:
        return follow(
            record,
            lambda: backend.refresh(store.get(record.id) or record, store),
            live=sys.stderr.isatty() and path is None,
            refresh_every_s=backend.poll_interval_s,
            path=path,
            wake=end_signal(record.id),  # a supervisor started here says when the job ended
        )
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            raise leave_view(record.id) from None
    click.echo(f"\ninterrupted: cancelling job {record.id}", err=True)
    previous = ignoring_interrupts()  # a cancel once begun is finished
    try:
        final = backend.cancel(store.get(record.id) or record, store)
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGINT, previous)
    _summary(final)
    raise click.exceptions.Exit(EXIT_INTERRUPTED)


def _summary(job: JobRecord, resumes: bool = True) -> None:
    """The end of a followed job: its state and reason, a resume from an older checkpoint
    (``resumes``: status has said it already), the failure's last lines."""
    took = ""
    if job.finished_at and job.submitted_at:
        took = f" in {job.finished_at - job.submitted_at:.1f}s"
    click.echo(f"job {job.id} {job.state}{took}" + (f": {job.reason}" if job.reason else ""),
               err=True)
    for line in older_resumes(Path(job.run_dir)) if resumes else ():
        click.echo(line, err=True)
    failure = job.failure
    if failure:
        if failure.last_lines:
            click.echo(f"last lines of rank {failure.rank} ({failure.node}):", err=True)
            for line in failure.last_lines:
                click.echo(f"  {line}", err=True)
        click.echo(f"full log: orchestrate logs {job.id} --rank {failure.rank}", err=True)


@click.command()
@click.argument("job_ref", metavar="JOB", shell_complete=completion.jobs)
@click.option("--follow/--detach", default=None,
              help="stream output until the job ends (default on a terminal; Ctrl-C then "
              "cancels the job and exits 130) or return at once")
def resume(job_ref: str, follow: bool | None) -> None:
    """Run an ended job again as its next attempt: same id and run directory, so the built-in
    trainer resumes from its last checkpoint; planned again from the job as it was submitted."""
    from orchestrate.backends.base import reloaded
    from orchestrate.run.prepare import plan_job

    store = _store()
    job = _refreshed(store, store.resolve(job_ref))
    if not job.terminal:
        raise UserError.single(f"job {job.id} is still {job.state}", field="JOB",
                               hint=f"`orchestrate cancel {job.id}` first, or wait for it")
    if job.state == "COMPLETED":
        raise UserError.single(f"job {job.id} completed: there is nothing to resume",
                               field="JOB", hint="submit the job file again to train anew")
    prepared = plan_job(reloaded(job), job.id)
    backend = get_backend(job.backend)
    from orchestrate.cli.progress import progress

    with progress("starting the job's supervisor"):  # it reports its phases and hosts
        record = backend.resume(job, prepared, store)
    if follow is None:
        follow = sys.stdout.isatty()
    click.echo(f"job {record.id} resumed: attempt {record.attempt}"
               + ("; Ctrl-C cancels it" if follow else ""), err=True)
    if not follow:
        click.echo(record.id)
        return
    final = _follow(store, record, cancel_on_interrupt=True)
    _summary(final)
    raise click.exceptions.Exit(_exit_status(final))


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("-n", "--limit", default=20, show_default=True, help="how many jobs")
def list_jobs(as_json: bool, limit: int) -> None:
    """Recent jobs, newest first."""
    store = _store()
    jobs = [_refreshed(store, j) if not j.terminal else j for j in store.list(limit)]
    if as_json:
        click.echo(json.dumps([j.to_json() for j in jobs], indent=2))
        return
    from rich.table import Table

    table = Table(title="jobs")
    for column in ("id", "backend", "state", "ranks", "attempts", "submitted", "run dir"):
        table.add_column(column)
    waiting = [j for j in jobs if j.state == "PENDING" and j.reason]
    for j in jobs:
        table.add_row(j.id, j.backend, j.state, str(j.plan.world_size), str(j.attempt),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.submitted_at)),
                      j.run_dir)
    out = console()
    out.print(table)
    for j in waiting:  # what each waiting job waits for, and who holds it
        out.print(f"{j.id} is {j.reason}", markup=False, soft_wrap=True)


def _rank_tables(out: Console, job: JobRecord) -> None:
    """``status``'s table of ranks, and of attempts when there were several."""
    from rich.table import Table

    table = Table()
    for column in ("rank", "node", "host", "pid", "state", "exit"):
        table.add_column(column)
    for r in job.ranks:
        exit_text = "" if r.exit_code is None and r.signal is None else (
            f"signal {r.signal}" if r.signal is not None else str(r.exit_code))
        # The host it ran on (a Slurm job runs where Slurm put it, whatever the plan named).
        table.add_row(str(r.rank), r.node, r.host or "-", str(r.pid or ""), r.state, exit_text)
    out.print(table)
    if len(job.attempts) > 1 or job.state == "RESTARTING":
        attempts = Table(title="attempts")
        for column in ("attempt", "started", "ended", "resumed from step", "why it ended"):
            attempts.add_column(column)
        for a in job.attempts:
            attempts.add_row(
                str(a.n), time.strftime("%H:%M:%S", time.localtime(a.started)),
                "-" if a.ended is None else time.strftime("%H:%M:%S", time.localtime(a.ended)),
                "-" if a.resumed_from_step is None else str(a.resumed_from_step),
                a.reason + (f" (excluded {', '.join(a.excluded_nodes)})"
                            if a.excluded_nodes else ""),
            )
        out.print(attempts)


@click.command()
@click.argument("job_ref", metavar="JOB", required=False, shell_complete=completion.jobs)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", is_flag=True,
              help="redraw per-rank pace, straggler, heartbeats and loss until the job ends; "
              "Ctrl-C leaves the view (exit 130), the job runs on")
def status(job_ref: str | None, as_json: bool, watch: bool) -> None:
    """A job's state, per-rank exit status, the first failure and the straggler (default: the
    latest job)."""
    from orchestrate.cli import report

    store = _store()
    job = _refreshed(store, resolve_or_latest(store, job_ref))
    job = store.get(job.id) or job
    if watch:
        from orchestrate.cli.interrupt import leave_view

        try:
            report.watch_job(store, job)
        except KeyboardInterrupt:
            raise leave_view(job.id, "watching") from None
        return
    foreign = _foreign_use(job)
    if as_json:
        click.echo(json.dumps({**report.status_json(job), "foreign_gpu_use": foreign},
                              indent=2))
        return
    out = console()
    out.print(f"job {job.id} ({job.name}) via {job.backend}: {job.state}"
              + (f" - {job.reason}" if job.reason else ""))
    from orchestrate.cli.live import why_lines

    # a diagnosis its reason has not said yet, then another user's use of the job's GPUs
    for line in [*why_lines(job.to_json())[1 if job.reason else 0:], *foreign]:
        out.print(line, markup=False, soft_wrap=True)
    out.print(f"run dir: {job.run_dir}")
    _rank_tables(out, job)
    for line in report.status_lines(job):
        out.print(line, markup=False)
    if job.failure:
        _summary(job, resumes=False)


@click.command()
@click.argument("job_ref", metavar="JOB", shell_complete=completion.jobs)
@click.option("--rank", type=int, default=None, help="only this rank's log")
@click.option("-f", "--follow", "follow_", is_flag=True,
              help="keep printing until the job ends; Ctrl-C stops printing (exit 130), the "
              "job runs on")
def logs(job_ref: str, rank: int | None, follow_: bool) -> None:
    """A job's merged output with [node:rank] prefixes, or one rank's.

    On a terminal, control characters (escape sequences, carriage returns) are shown as \\xNN;
    piped or redirected, the bytes are the ranks' own."""
    from orchestrate.cli.follow import dump, reader

    store = _store()
    job = store.resolve(job_ref)
    run_dir = Path(job.run_dir)
    path = None
    if rank is not None:
        if not any(r.rank == rank for r in job.ranks):
            raise UserError.single(f"job {job.id} has no rank {rank}", field="--rank",
                                   hint=f"ranks are 0-{len(job.ranks) - 1}")
        path = rank_log(run_dir, rank)
    try:
        if follow_:
            _follow(store, job, path)
        else:
            dump(reader(run_dir, path))
    except BrokenPipeError:  # `orchestrate logs JOB | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit


@click.command()
@click.argument("job_refs", metavar="JOB...", nargs=-1, required=True,
                shell_complete=completion.running_jobs)
def cancel(job_refs: tuple[str, ...]) -> None:
    """Stop every process of the job(s), on every host."""
    store = _store()
    for ref in job_refs:
        job = store.resolve(ref)
        if job.terminal:
            click.echo(f"job {job.id} already {job.state}")
            continue
        final = get_backend(job.backend).cancel(job, store)
        click.echo(f"job {final.id} {final.state}")


def _foreign_use(job: JobRecord) -> list[str]:
    """Other users' processes on the GPUs of a running job, as its supervisor last saw them."""
    from orchestrate.core.layout import FOREIGN_GPU_USE

    if job.state != "RUNNING":
        return []
    try:
        lines = json.loads((Path(job.run_dir) / FOREIGN_GPU_USE).read_text())
    except (OSError, ValueError):
        return []
    return [str(line) for line in lines] if isinstance(lines, list) else []
