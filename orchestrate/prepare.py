"""From a job file on disk to a plan and its scripts: the shell around the pure core.

``plan``, ``render`` and ``submit`` all come through here, so what ``render`` prints is what
``submit`` writes. This module reads files, probes this machine for local jobs without an
inventory, and counts the model's parameters; the core it calls does none of that.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrate.errors import UserError
from orchestrate.inventory import Inventory, load_inventory
from orchestrate.job import JobSpec, job_dir, load_job
from orchestrate.machine import local_inventory
from orchestrate.plan import Plan, make_plan


def new_id_suffix() -> str:
    """Job ids are ``<name>-<6 hex>``: readable, unique enough for one user's store, and safe
    in file names."""
    return secrets.token_hex(3)


#: Job id used by ``plan`` and ``render`` when none is given (``submit`` makes a fresh one).
PREVIEW_SUFFIX = "dryrun"


@dataclass(frozen=True)
class Prepared:
    """A job made ready to launch."""

    path: Path
    overrides: tuple[str, ...]
    job: JobSpec
    inventory: Inventory
    plan: Plan
    files: dict[str, str]
    templates_dir: Path | None


def run_root(job: JobSpec, path: Path) -> Path:
    """Where run directories go: the job's ``run_root``, else $ORCHESTRATE_RUNS, else ./runs."""
    if job.run_root is not None:
        return (job_dir(path) / os.path.expanduser(job.run_root)).resolve()
    return Path(os.environ.get("ORCHESTRATE_RUNS", "runs")).expanduser().resolve()


def load(path: Path, overrides: tuple[str, ...] = ()) -> tuple[JobSpec, Inventory]:
    """The job (with overrides) and its inventory."""
    job = load_job(path, overrides)
    if job.inventory is None:
        if job.backend != "local":
            raise UserError.single(
                f"the {job.backend} backend needs an inventory",
                source=str(path),
                field="inventory",
                hint="point 'inventory' at a file describing the nodes (see inventory/)",
            )
        return job, local_inventory()
    inv_path = job_dir(path) / os.path.expanduser(job.inventory)
    if not inv_path.exists():
        raise UserError.single(
            "inventory file not found",
            source=str(path),
            field="inventory",
            got=str(inv_path),
            hint="the path is relative to the job file",
        )
    return job, load_inventory(inv_path)


def prepare(
    path: Path,
    overrides: tuple[str, ...] = (),
    *,
    job_id: str | None = None,
    id_suffix: str | None = None,
    busy_gpus: Mapping[str, frozenset[int]] | None = None,
    master_port: int | None = None,
    interfaces: Mapping[str, str] | None = None,
    render_files: bool = True,
) -> Prepared:
    """Load, plan and render a job file (``render_files=False``: the plan only, ``files`` empty;
    ``orchestrate plan`` needs no scripts, and a 4,096-node job renders 4,096 of them).

    ``job_id`` names the job; else ``<name>-<id_suffix>`` (``submit`` passes a fresh suffix),
    else ``<name>-dryrun``. ``busy_gpus``, ``master_port`` and ``interfaces`` are facts a
    backend found on the hosts (leases, a free port, the interface towards the master); see
    :func:`make_plan`.
    """
    job, inventory = load(path, overrides)
    job_id = job_id or f"{job.name}-{id_suffix or PREVIEW_SUFFIX}"
    run_dir = run_root(job, path) / job_id
    workdir = (job_dir(path) / os.path.expanduser(job.workdir or ".")).resolve()
    params, note = _count_params(job, inventory, workdir)
    plan = make_plan(
        job,
        inventory,
        job_id=job_id,
        run_dir=str(run_dir),
        workdir=str(workdir),
        source=str(path),
        python=sys.executable if job.backend == "local" else "python3",
        param_count=params,
        busy_gpus=busy_gpus,
        master_port=master_port,
        interfaces=interfaces,
    )
    if note:
        plan = replace(plan, notes=(*plan.notes, note))
    templates_dir = (
        None if job.templates_dir is None else (job_dir(path) / job.templates_dir).resolve()
    )
    if templates_dir is not None and not templates_dir.is_dir():
        raise UserError.single(
            "templates folder not found",
            source=str(path),
            field="templates_dir",
            got=str(templates_dir),
        )
    files: dict[str, str] = {}
    if render_files:
        from orchestrate.render import render  # Jinja is imported only when scripts are wanted

        files = render(plan, templates_dir)
    return Prepared(path, tuple(overrides), job, inventory, plan, files, templates_dir)


def _count_params(job: JobSpec, inventory: Inventory, workdir: Path) -> tuple[float | None, str]:
    """Count the model on the meta device when the memory check needs it and can have it."""
    if job.train is None or job.train.model_params is not None:
        return None, ""
    if not any(node.is_gpu for node in inventory.nodes):
        return None, ""
    try:
        from orchestrate.train.params import param_count
    except ImportError:
        return None, "memory check skipped: torch is not installed here (set train.model_params)"
    sys.path.insert(0, str(workdir))
    try:
        return float(param_count(job.train)), ""
    except Exception as exc:  # the user's factory: any failure only skips the check
        return None, f"memory check skipped: counting the model failed ({exc})"
    finally:
        sys.path.remove(str(workdir))
