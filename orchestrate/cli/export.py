"""``orchestrate export JOB [--step N] -o FILE``: a job's weights as a plain state dict."""

from __future__ import annotations

from pathlib import Path

import click

from orchestrate.cli import completion
from orchestrate.core.errors import UserError


def _checkpoints(job_ref: str) -> Path:
    """Where the checkpoints of ``job_ref`` are: a job of the store (its plan says), or a
    path (a run directory, its checkpoints, or one checkpoint)."""
    given = Path(job_ref).expanduser()
    if given.exists():
        inner = given / "checkpoints"
        return inner if inner.is_dir() else given
    from orchestrate.core.plan.plan import checkpoint_dir
    from orchestrate.run.store import Store

    job = Store().resolve(job_ref)
    where = checkpoint_dir(job.plan)
    if where is None:
        raise UserError.single(
            "runs a command, not the built-in trainer: its checkpoints are its own",
            field="JOB", got=job.id, hint="export applies to jobs with a train: section")
    return Path(where)


@click.command()
@click.argument("job_ref", metavar="JOB", shell_complete=completion.jobs)
@click.option("--step", type=int, default=None, help="the checkpoint of this optimizer step "
              "(default: the latest)")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="the file to write (torch.save of {parameter name: tensor})")
def export(job_ref: str, step: int | None, output: Path) -> None:
    """Write a job's trained weights (DDP or FSDP checkpoint) as one plain state dict."""
    source = _checkpoints(job_ref)
    try:
        from orchestrate.train.export import export as write
        from orchestrate.train.failure import TrainFailure
    except ImportError:
        raise UserError.single("needs torch, which is not installed here", field="JOB",
                               hint="run it where the job's Python environment is") from None
    skipped: list[str] = []
    try:
        chosen, count = write(source, output, step, skipped)
    except TrainFailure as exc:
        raise UserError.single(str(exc), field="--step" if step is not None else "JOB",
                               got=step if step is not None else job_ref) from None
    for why in skipped:
        click.echo(f"note: passed over checkpoint {why}", err=True)
    click.echo(f"{output}: {count} tensors from {chosen}")
