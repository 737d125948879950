"""``orchestrate doctor``: the planned job's nodes checked through the job's own backend.

The doctor runs one *derived* job: the user's job (same inventory, nodes, GPUs or slots,
interfaces, environment, backend) with its program replaced by the checkup,
``python -m orchestrate.doctor.checkup --tier ...`` (:mod:`orchestrate.doctor.checkup`), no
restarts, and a time limit of its own. So every rank starts exactly as the job's ranks will, through
the same
launcher, and a fault that would hang the job (an interface, a firewall, a missing library)
shows up here instead. Where the backend picks hosts itself (SSH and local: the plan's; Slurm:
wherever Slurm places the job) the report names the nodes that really ran.

Steps, each bounded: plan the job (a user error exits 2, as ``plan`` does); submit the derived
job (a backend that refuses to launch it, such as an SSH host that cannot be reached, becomes
failed checks naming the host); wait for it within a hard bound (the checkup's own deadline
plus a launch allowance; past it the job is cancelled and what did not report is named); read
every rank's log for the checkup's marked lines (:mod:`orchestrate.doctor.checkup.transcript`: the
output is what comes back on every backend); grade (:func:`orchestrate.doctor.findings.assess`);
write ``doctor.json`` (the ``--json`` document) and ``doctor.html`` (:mod:`orchestrate.doctor.page`)
into the doctor job's run directory.

The master port: a port the job fixes (``distributed.master_port``, ``MASTER_PORT``) is tested
as is; a derived one is derived for the doctor's own job id, from the same range (the job's
port is derived from *its* id at submit, so no earlier run can test that exact number).
"""

from __future__ import annotations

import math
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.core.errors import UserError
from orchestrate.core.layout import DOCTOR_FILE, OWN_REACH_CHECK, rank_log
from orchestrate.core.spec.backendtraits import traits
from orchestrate.doctor import findings, grading
from orchestrate.doctor.checkup import transcript
from orchestrate.doctor.checkup.options import NODE_TIERS
from orchestrate.run.progress import hosts, show

if TYPE_CHECKING:
    from orchestrate.backends.base import Backend
    from orchestrate.core.plan.plan import Plan
    from orchestrate.doctor.grading import Check, JobShape
    from orchestrate.run.prepare import Loaded, Prepared
    from orchestrate.run.store import JobRecord, Store

DOCTOR_PAGE = "doctor.html"
#: How long the backend may take to start the job before the checkup's own clock runs: SSH
#: preflight and copies, a Slurm queue (a busy queue needs ``--deadline-s``).
LAUNCH_ALLOWANCE_S = 120.0
#: After the checkup's deadline: its ranks' exit and the backend noticing it.
TEARDOWN_S = 30.0
#: Sizes per sweep when none are given (the checkup's defaults, CPU and GPU alike).
DEFAULT_SIZES = 5


@dataclass(frozen=True)
class Settings:
    """What to check and the bounds (the ``doctor`` command's options)."""

    tier: str = "all"
    sizes: str | None = None
    pair_size: str | None = None
    budget_s: float | None = None
    timeout_s: float = 20.0
    join_timeout_s: float = 30.0
    window_s: float = 20.0
    deadline_s: float | None = None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers run: ``tier`` and those before it (without ``health`` under
        ``ORCHESTRATE_GPU_HEALTH=off``, unless it is the tier asked for)."""
        from orchestrate.backends.sharing import health_on

        tiers = findings.tiers_up_to(self.tier)
        if self.tier != "health" and not health_on():
            tiers = tuple(t for t in tiers if t != "health")
        return tiers


def checkup_argv(plan: Plan, settings: Settings, with_deadline: bool = True) -> list[str]:
    """The checkup's arguments for ``plan`` (after ``python -m orchestrate.doctor.checkup``)."""
    argv = ["--tier", ",".join(settings.tiers), "--nodes", str(len(plan.nodes)),
            "--connect-window-s", _num(settings.window_s),
            "--join-timeout-s", _num(settings.join_timeout_s),
            "--timeout-s", _num(settings.timeout_s)]
    if not traits(plan.backend).scheduler_allocates:
        # A scheduler (Slurm) chooses the hosts: there each rank names its node itself
        # (SLURMD_NODENAME).
        argv += ["--node-names", ",".join(n.name for n in plan.nodes)]
    if settings.sizes:
        argv += ["--sizes", settings.sizes]
    if settings.pair_size:
        argv += ["--pair-size", settings.pair_size]
    if settings.budget_s is not None:
        argv += ["--budget-s", _num(settings.budget_s)]
    if with_deadline:
        argv += ["--deadline-s", _num(math.ceil(checkup_deadline_s(plan, settings)))]
    return argv


def checkup_deadline_s(plan: Plan, settings: Settings) -> float:
    """The hard bound of every rank's checkup (the rank program's own rule)."""
    from orchestrate.doctor.checkup.options import deadline_s, parse_options

    options = parse_options(checkup_argv(plan, settings, with_deadline=False), {})
    return deadline_s(options, len(options.sizes or ()) or DEFAULT_SIZES, len(plan.nodes))


def bound_s(plan: Plan, settings: Settings) -> float:
    """How long the doctor waits for its job, all told."""
    if settings.deadline_s is not None:
        return settings.deadline_s
    return LAUNCH_ALLOWANCE_S + checkup_deadline_s(plan, settings) + TEARDOWN_S


def doctor_job_id(base: str) -> str:
    """A fresh id for the doctor's job: ``<job>-doctor-<6 hex>`` (at most 64 characters)."""
    return f"{base[:48].rstrip('.-_')}-doctor-{secrets.token_hex(3)}"


def derive(loaded: Loaded, plan: Plan, settings: Settings) -> Loaded:
    """The doctor's job: ``loaded``'s job running the checkup on the plan's nodes, once, within
    a time limit (which every backend enforces, so the job ends even if the doctor does not)."""
    from orchestrate.core.spec.restartspec import RestartPolicy

    job = loaded.job
    limit = bound_s(plan, settings)
    kind = traits(job.backend)
    if kind.signals_before_limit:
        # Slurm sends the job's stop signal this long before the limit (it would end the
        # checkup early): the limit leaves room for it.
        limit += job.slurm.signal_seconds_before
    minutes = max(1, math.ceil(limit / 60))
    resources: dict[str, Any] = {"time": str(minutes)}
    if not kind.scheduler_allocates:
        resources["node_names"] = [n.name for n in plan.nodes]
    derived = job.model_copy(update={
        "train": None,
        "command": ["python", "-m", "orchestrate.doctor.checkup", *checkup_argv(plan, settings)],
        "restart": RestartPolicy(max=0),
        "resources": job.resources.model_copy(update=resources),
        # its connect tier checks every node's reach of the master, naming the one that cannot
        "env": {**job.env, OWN_REACH_CHECK: "1"},
    })
    return replace(loaded, job=derived, param_count=None, notes=())


@dataclass
class Run:
    """One doctor run: what was checked, what was found, where the files are."""

    job_id: str
    run_dir: Path
    backend: str
    shape: JobShape
    tiers: tuple[str, ...]
    checks: list[Check]
    document: dict[str, Any]
    seconds: float
    end: findings.JobEnd
    files: list[Path] = field(default_factory=list)

    @property
    def exit_status(self) -> int:
        """0 when nothing failed, 1 when a check failed."""
        return grading.exit_status(self.checks)

    @property
    def verdict(self) -> str:
        return grading.verdict(self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]


def run(prepared: Prepared, settings: Settings, *, store: Store | None = None,
        say: Callable[[str], None] | None = None) -> Run:
    """Check the nodes of ``prepared``'s plan (see the module docstring); never hangs."""
    from orchestrate.backends import get_backend
    from orchestrate.doctor.grading import shape_of
    from orchestrate.run.prepare import plan_job
    from orchestrate.run.store import Store

    began = time.monotonic()
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    store = store or Store()
    plan = prepared.plan
    inventory = prepared.inventory
    backend = get_backend(plan.backend)
    job_id = doctor_job_id(plan.job_id if not plan.job_id.endswith("-dryrun")
                           else plan.job_name)
    derived = plan_job(derive(prepared.loaded, plan, settings), job_id)
    bound = bound_s(derived.plan, settings)
    say(f"doctor: {', '.join(settings.tiers)} on {len(plan.nodes)} node(s), "
        f"{plan.world_size} rank(s) via {plan.backend}, as job {job_id} (at most {bound:.0f} s)")
    deadline = began + bound
    run_dir = Path(derived.plan.run_dir)
    record: JobRecord | None = None
    phases: dict[str, float] = {}
    try:
        try:
            record = backend.submit(derived, store)
        except UserError as exc:
            end = findings.JobEnd("REFUSED", reason=f"{plan.backend} backend",
                                  refused=exc.problems)
        else:
            phases["launch"] = time.monotonic() - began
            record, end = _wait(backend, store, record, deadline, bound,
                                lambda: _show_tier(run_dir, derived.plan, settings.tiers))
            phases["run"] = time.monotonic() - began - phases["launch"]
    except KeyboardInterrupt:
        if record is not None:
            say(f"doctor: interrupted: cancelling job {record.id}")
            backend.cancel(store.get(record.id) or record, store)
        raise
    ran = record.plan if record is not None else derived.plan
    payloads = read_payloads(run_dir, ran.world_size)
    shape = findings.ran_on(shape_of(ran, inventory), inventory, payloads)
    checks, bandwidth = findings.assess(shape, settings.tiers, payloads, end)
    document = grading.document(checks, bandwidth)
    seconds = time.monotonic() - began
    document["doctor"] = {
        "job_id": job_id, "job": plan.job_name, "backend": plan.backend,
        "tiers": list(settings.tiers), "nodes": list(shape.names),
        "world_size": ran.world_size, "seconds": round(seconds, 2), "run_dir": str(run_dir),
        "ended": end.state, "phases_s": {**{k: round(v, 2) for k, v in phases.items()},
                                         **_checkup_phases(payloads)},
    }
    result = Run(job_id, run_dir, plan.backend, shape, settings.tiers, checks, document,
                 seconds, end)
    result.files = write(result)
    return result


def _checkup_phases(payloads: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Where the checkup's time went: the slowest node leader's static and connect tiers, and
    rank 0's smoke and bandwidth tiers (from its store's start)."""
    out: dict[str, float] = {}
    leaders = [float(p.get("seconds") or 0) for p in payloads if p.get("kind") == "node"]
    if leaders:
        out["node_tiers"] = round(max(leaders), 2)
    result = [p for p in payloads if p.get("kind") == "result"]
    if result:
        out["rank_tiers"] = round(float(result[-1].get("elapsed_s") or 0), 2)
    return out


def tier_phase(tiers: Sequence[str], nodes: Sequence[str], done: Sequence[str]
               ) -> tuple[str, str | None]:
    """What the checkup does now, for the progress line: the node tiers (static, connect) on
    the nodes that have not reported them (``done``), then the rank tiers (smoke, bandwidth)."""
    node_tiers = [t for t in tiers if t in NODE_TIERS]
    rank_tiers = [t for t in tiers if t not in node_tiers]
    left = [n for n in nodes if n not in done]
    if node_tiers and left:
        return f"doctor: {_tiers(node_tiers)}", hosts(left)
    if rank_tiers:
        return f"doctor: {_tiers(rank_tiers)}", hosts(list(nodes))
    return "doctor: grading", None


def _tiers(names: Sequence[str]) -> str:
    if len(names) == 1:
        return f"{names[0]} tier"
    return ", ".join(names[:-1]) + f" and {names[-1]} tiers"


def _show_tier(run_dir: Path, plan: Plan, tiers: Sequence[str]) -> None:
    done = [str(p.get("node")) for p in read_payloads(run_dir, plan.world_size)
            if p.get("kind") == "node"]
    show(*tier_phase(tiers, [n.name for n in plan.nodes], done))


def _wait(backend: Backend, store: Store, record: JobRecord, deadline: float, bound: float,
          progress: Callable[[], None] = lambda: None) -> tuple[JobRecord, findings.JobEnd]:
    """Follow the job until it ends or the deadline passes (then cancel it); ``progress`` is
    called between two looks."""
    from orchestrate.backends import detached

    while True:
        progress()
        current = store.get(record.id) or record
        record = backend.refresh(current, store)
        if record.terminal:
            break
        if time.monotonic() > deadline:
            state = record.state
            record = backend.cancel(record, store)
            return record, findings.JobEnd(
                "DEADLINE", reason=f"the doctor cut its job off after {bound:.0f} s "
                f"(it was {state})",
                failed_node=None)
        time.sleep(min(backend.poll_interval_s, max(0.05, deadline - time.monotonic())))
    # A supervisor on this machine releases the job's leases as it exits: wait for that, so a
    # job submitted right after (submit --preflight) finds its GPUs, slots and port free.
    if record.supervisor_pid is not None and detached.on_this_machine(record):
        until = time.monotonic() + 10
        while detached.alive(record.supervisor_pid, record.id) and time.monotonic() < until:
            time.sleep(0.05)
    failure = record.failure
    return record, findings.JobEnd(
        record.state, reason=record.reason,
        failed_rank=None if failure is None else failure.rank,
        failed_node=None if failure is None else failure.node,
        last_lines=tuple(failure.last_lines) if failure is not None else (),
    )


def read_payloads(run_dir: Path, world_size: int) -> list[dict[str, Any]]:
    """Every marked line in the ranks' logs, rank by rank."""
    found: list[dict[str, Any]] = []
    for rank in range(world_size):
        try:
            text = rank_log(run_dir, rank).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found.extend(transcript.read(text))
    return found


def write(run: Run) -> list[Path]:
    """``doctor.json`` and ``doctor.html`` into the doctor job's run directory."""
    import json

    from orchestrate.doctor import page as doctorpage

    run.run_dir.mkdir(parents=True, exist_ok=True)
    target = run.run_dir / DOCTOR_FILE
    target.write_text(json.dumps(run.document, indent=2) + "\n", encoding="utf-8")
    meta = dict(run.document.get("doctor") or {})
    meta["generated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    page = run.run_dir / DOCTOR_PAGE
    page.write_text(doctorpage.render(run.document, meta), encoding="utf-8")
    return [target, page]


def names(checks: Sequence[Check]) -> str:
    """What failed, in a few words: ``static interface (h2); smoke join (h3)``."""
    return "; ".join(f"{c.tier} {c.name} ({', '.join(c.nodes)})" for c in checks)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
