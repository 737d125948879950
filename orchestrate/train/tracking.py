"""One W&B run and one TensorBoard log per job, whatever the number of attempts.

A restarted attempt (``ORCHESTRATE_ATTEMPT`` 2, 3...) or ``orchestrate resume`` runs in the same
run directory under the same job id. Opening a new W&B run per attempt left users stitching runs
by hand; so the W&B run id is the job's (``ORCHESTRATE_JOB_ID``, or an id kept in the run
directory when the trainer runs without orchestrate), every attempt resumes it
(``resume="allow"``) and adds the tag ``attempt-N``. TensorBoard's log directory is the run
directory's ``tensorboard/`` for every attempt; a resumed attempt writes with
``purge_step`` = the step it resumed from, so the steps an earlier attempt logged after its last
checkpoint (trained again now) are dropped from the charts rather than drawn twice, and it
records the attempt number as text at that step.

Both are optional: a sink that is asked for and not installed is a note on stdout, never a
failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.core.spec.trainspec import TrainSpec

#: Where a run directory keeps its W&B run id when no job id is set (the trainer started by
#: hand): the next start in the same directory reuses it.
ID_FILE = "tracking-id"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Tracking:
    """Who this attempt logs as."""

    run_id: str  # the W&B run id, the same for every attempt of the job
    attempt: int  # 1, then 2 after a restart or a resume
    name: str  # the run's display name

    @property
    def tag(self) -> str:
        return f"attempt-{self.attempt}"


def tracking_for(run_dir: Path, environ: Mapping[str, str]) -> Tracking:
    """The job's tracking identity (an id file may be written in ``run_dir``)."""
    raw = environ.get("ORCHESTRATE_ATTEMPT", "").strip()
    attempt = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    job = environ.get("ORCHESTRATE_JOB_ID", "").strip()
    run_id = _UNSAFE.sub("-", job) if job else _kept_id(run_dir)
    return Tracking(run_id=run_id, attempt=attempt, name=job or run_dir.name)


def _kept_id(run_dir: Path) -> str:
    path = run_dir / ID_FILE
    try:
        kept = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        kept = ""
    if kept and not _UNSAFE.search(kept):
        return kept
    made = uuid.uuid4().hex[:16]
    with contextlib.suppress(OSError):  # a read-only run directory: this attempt's id only
        path.write_text(made + "\n", encoding="ascii")
    return made


def wandb_options(track: Tracking, run_dir: Path, spec: TrainSpec,
                  environ: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments of ``wandb.init`` for this attempt."""
    return {
        "project": environ.get("WANDB_PROJECT", "orchestrate"),
        "id": track.run_id,
        "resume": "allow",
        "name": track.name,
        "dir": str(run_dir),
        "config": spec.model_dump(mode="json"),
        "tags": [track.tag],
    }


def open_wandb(track: Tracking, run_dir: Path, spec: TrainSpec) -> Any:
    """The job's W&B run, resumed by id (None when wandb is not installed)."""
    try:
        import wandb  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print("wandb: asked for but not installed (pip install wandb); skipped", flush=True)
        return None
    run = wandb.init(**wandb_options(track, run_dir, spec, os.environ))
    # A resumed run keeps the tags of earlier attempts (init's tags would replace them).
    run.tags = tuple(sorted({*(run.tags or ()), track.tag}))
    return run


def open_tensorboard(track: Tracking, run_dir: Path, resumed_from: int | None) -> Any:
    """The job's TensorBoard writer in ``run_dir/tensorboard`` (None when not installed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard: asked for but not installed (pip install tensorboard); skipped",
              flush=True)
        return None
    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resumed_from)
    writer.add_text("orchestrate/attempt", f"attempt {track.attempt} ({track.run_id})",
                    resumed_from or 0)
    return writer
