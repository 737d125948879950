"""From a job file on disk to a plan and its scripts: the shell around the pure core.

Two halves. :func:`load` does the I/O, once per submit: it reads the job file (with ``--set``
overrides) and its inventory, probes this machine for local jobs without an inventory, and counts
the model's parameters by importing the user's factory. :func:`plan_job` is pure: from what was
loaded, a job id and the facts a backend found on its hosts, it makes the plan; the backend
renders its scripts from it (``Backend.files``). Backends re-plan (other jobs' GPUs, a busy port,
a discovered interface) by calling :func:`plan_job` again; they never read the files a second
time, so the job that runs is the job ``submit`` showed even if its file is edited meanwhile.
``plan``, ``render`` and ``submit`` all come through here, so what ``render`` prints is what
``submit`` writes.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.plan import frameworkfsdp
from orchestrate.core.plan.memory import ModelFacts
from orchestrate.core.plan.plan import Occupancy, Plan, make_plan
from orchestrate.core.plan.ports import unreachable_addresses
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.backendtraits import traits
from orchestrate.core.spec.inventory import (
    Inventory,
    InventorySpec,
    load_inventory_spec,
    resolve_inventory,
)
from orchestrate.core.spec.job import JobSpec, Lines, check_job_id, job_dir, read_job
from orchestrate.core.spec.loader import read_yaml
from orchestrate.run import programtext
from orchestrate.run.loaded import Loaded as Loaded  # re-exported: ``run.prepare`` names both
from orchestrate.run.loaded import Prepared as Prepared
from orchestrate.run.progress import show

#: Job id used by ``plan`` and ``render`` when none is given (``submit`` makes a fresh one).
PREVIEW_SUFFIX = "dryrun"


def new_id_suffix() -> str:
    """Job ids are ``<name>-<6 hex>``: readable, unique enough for one user's store, and safe
    in file names."""
    return secrets.token_hex(3)


def load(path: Path, overrides: tuple[str, ...] = ()) -> Loaded:
    """Read a job file (with ``--set`` overrides) and everything it needs."""
    job, lines = read_job(path, overrides)
    return load_spec(job, job_dir(path), str(path), overrides, lines)


def load_spec(
    job: JobSpec, base: Path, source: str = "<JobSpec>", overrides: tuple[str, ...] = (),
    lines: Lines | None = None,
) -> Loaded:
    """Load what a job spec needs; its relative paths are relative to ``base``. The code that
    ``train:`` names must resolve from the workdir (:mod:`orchestrate.train.importcheck`)."""
    inventory, spec, inventory_source = _inventory(job, base, source)
    workdir = (base / os.path.expanduser(job.workdir or ".")).resolve()
    templates_dir = None
    if job.templates_dir is not None:
        templates_dir = (base / job.templates_dir).resolve()
        if not templates_dir.is_dir():
            raise UserError.single("templates folder not found", source=source,
                                   field="templates_dir", got=str(templates_dir))
    notes = _imports(job, workdir, source, lines or {}, overrides)
    model, note = _model(job, inventory, workdir, source)
    return Loaded(
        source=source,
        overrides=tuple(overrides),
        job=job,
        inventory=inventory,
        inventory_spec=spec,
        inventory_source=inventory_source,
        workdir=workdir,
        runs=_runs(job, base),
        templates_dir=templates_dir,
        param_count=None if model is None else model.params,
        notes=(*notes, note) if note else tuple(notes),
        model=model,
        fsdp_signs=() if job.train is not None else
        tuple(programtext.fsdp_signs(job.command, job.env, workdir)),
    )


def plan_job(
    loaded: Loaded,
    job_id: str,
    occupancy: Occupancy | None = None,
) -> Prepared:
    """Plan a loaded job (pure). Its scripts are its backend's to render, when they are wanted:
    ``orchestrate plan`` needs none, and a 4,096-node job would render 4,096 of them."""
    plan = make_plan(
        loaded.job,
        loaded.inventory,
        job_id=job_id,
        run_dir=str(loaded.run_dir(job_id)),
        workdir=str(loaded.workdir),
        source=loaded.source,
        python=default_python(loaded.job),
        param_count=loaded.param_count,
        occupancy=occupancy,
        debug=loaded.debug,
        model=loaded.model,
    )
    warnings, notes = frameworkfsdp.advice(list(loaded.fsdp_signs),
                                           any(n.gpu_indices for n in plan.nodes))
    if loaded.notes or warnings or notes:
        plan = replace(plan, warnings=(*plan.warnings, *warnings),
                       notes=(*plan.notes, *loaded.notes, *notes))
    _check_reachable(loaded, plan)
    return Prepared(loaded, plan)


def _check_reachable(loaded: Loaded, plan: Plan) -> None:
    """A job over several nodes whose MASTER_ADDR or a node's address is loopback would wait
    in rendezvous until its timeout: refused here, at the file and line that say it."""
    found = unreachable_addresses([(n.name, n.address) for n in plan.nodes], plan.master_addr,
                                  plan.master_addr_fixed)
    if not found:
        return
    problems = []
    key: tuple[str, ...]
    for bad in found:
        if bad.node is None:
            source, key = loaded.source, ("distributed", "master_addr")
            field = "distributed.master_addr"
        else:
            index = _entry_of(loaded.inventory_spec, bad.node)
            source, key = loaded.inventory_source, ("nodes", str(index), "address")
            field = f"nodes.{index}.address"
        problems.append(Problem(bad.message, source=source, field=field,
                                line=_line_of(source, key), got=bad.address, hint=bad.hint))
    raise UserError(problems)


def _entry_of(spec: InventorySpec, node: str) -> int:
    """The index of the inventory entry that holds ``node`` (its hostlist expanded)."""
    for index, entry in enumerate(spec.nodes):
        if node in hostlist.expand(entry.name):
            return index
    return 0


def _line_of(source: str, key: tuple[str, ...]) -> int | None:
    """The line of ``key`` in the YAML file ``source`` (read again: only on a refusal)."""
    try:
        _, lines = read_yaml(Path(source))
    except (OSError, UserError):
        return None
    return lines.get(key) or lines.get(key[:-1])


def default_python(job: JobSpec) -> str:
    """The interpreter of the job's nodes whose inventory names none: this one, where the
    backend runs ranks under the submitting interpreter, else ``python3`` on the node's PATH."""
    return sys.executable if traits(job.backend).default_python == "submitter" else "python3"


def prepare(
    path: Path,
    overrides: tuple[str, ...] = (),
    *,
    job_id: str | None = None,
    id_suffix: str | None = None,
    debug: bool = False,
) -> Prepared:
    """Load and plan a job file. ``job_id`` names the job; else ``<name>-<id_suffix>``
    (``submit`` passes a fresh suffix), else ``<name>-dryrun``."""
    if job_id is not None:
        try:
            check_job_id(job_id)
        except ValueError as exc:
            raise UserError.single(str(exc), field="--job-id", got=job_id,
                                   hint="a job id names a folder: no '/' and no '..'") from None
    loaded = load(path, overrides)
    job_id = job_id or f"{loaded.job.name}-{id_suffix or PREVIEW_SUFFIX}"
    if debug:
        loaded = replace(loaded, debug=True)
    return plan_job(loaded, job_id)


def _inventory(
    job: JobSpec, base: Path, source: str
) -> tuple[Inventory, InventorySpec, str]:
    if job.inventory is None:
        if traits(job.backend).needs_inventory:
            raise UserError.single(
                f"the {job.backend} backend needs an inventory",
                source=source,
                field="inventory",
                hint="point 'inventory' at a file describing the nodes (see inventory/)",
            )
        from orchestrate.probe.machine import local_inventory_spec

        spec = local_inventory_spec()
        return resolve_inventory(spec), spec, ""
    inv_path = base / os.path.expanduser(job.inventory)
    if not inv_path.exists():
        raise UserError.single(
            "inventory file not found",
            source=source,
            field="inventory",
            got=str(inv_path),
            hint="the path is relative to the job file",
        )
    spec, lines = load_inventory_spec(inv_path)
    return resolve_inventory(spec, str(inv_path), lines), spec, str(inv_path)


def _runs(job: JobSpec, base: Path) -> Path:
    """Where run directories go: the job's ``run_root``, else $ORCHESTRATE_RUNS, else ./runs."""
    if job.run_root is not None:
        return (base / os.path.expanduser(job.run_root)).resolve()
    return Path(os.environ.get("ORCHESTRATE_RUNS", "runs")).expanduser().resolve()


def _imports(job: JobSpec, workdir: Path, source: str, lines: Lines,
             overrides: tuple[str, ...]) -> list[str]:
    """Refuse ``train:`` code paths that do not resolve here (exit 2); notes otherwise."""
    if job.train is None:
        return []
    from orchestrate.train import importcheck

    elsewhere = traits(job.backend).default_python != "submitter"
    pythonpath = job.env.get("PYTHONPATH")
    problems, notes = importcheck.check(job.train, workdir, source, lines, overrides, elsewhere,
                                        None if pythonpath is None else str(pythonpath))
    if problems:
        raise UserError(problems)
    return notes


def _model(job: JobSpec, inventory: Inventory, workdir: Path, source: str
           ) -> tuple[ModelFacts | None, str]:
    """The model's size, layout and traced peaks when the plan uses them
    (:mod:`orchestrate.train.modelfacts`: a bounded child process)."""
    from orchestrate.train import modelfacts

    if not modelfacts.wanted(job, inventory):
        return None, ""
    show("tracing the model's memory (a child process, up to a minute)")
    return modelfacts.probe(job, workdir, source)
