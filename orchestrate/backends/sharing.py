"""A machine's users in one lease book: what the local and SSH backends share about it.

The book itself (files, permissions, locking, liveness, the queue) is
:mod:`orchestrate.hostside.leases`, which runs on every host; GPUs in use outside orchestrate are
read by :mod:`orchestrate.hostside.gpuuse`. This module turns what they found into what the pure
planner takes (:class:`~orchestrate.core.plan.plan.Occupancy`'s fields), says what a waiting
job's ticket asks for, and turns the book's own failures into user errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.core.errors import UserError
from orchestrate.core.gpuhealth import HostHealth, judge
from orchestrate.core.plan.placement import wanted_gpus
from orchestrate.core.plan.strategy import model_facts, placement_need
from orchestrate.core.spec.backendtraits import traits
from orchestrate.hostside.containment import user_name
from orchestrate.hostside.leaserecord import Ticket, summary
from orchestrate.hostside.leases import BookError

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import NodePlan
    from orchestrate.run.jobrecord import LeaseBooks
    from orchestrate.run.loaded import ClaimFacts, NodeClaim, Prepared


def book_error(exc: BookError, source: str, host: str = "") -> UserError:
    """The book cannot be used: not the user's mistake. Its lock stayed held: exit 75 (try
    again later); else the machine's setup, with the fix for root: exit 78."""
    where = f"{host}: " if host else ""
    return UserError.single(f"{where}{exc}", source=source, field="leases",
                            hint=exc.hint or "see docs/shared-servers.md", busy=exc.busy,
                            setup=not exc.busy)


def lease_dir(prepared: Prepared, node: str) -> str | None:
    """The inventory's ``lease_dir`` for ``node`` (None: the host's default book)."""
    if prepared.facts is not None and node in prepared.facts.nodes:
        return prepared.facts.nodes[node].lease_dir
    spec = prepared.inventory.node(node)
    return spec.lease_dir if spec is not None else None


def node_claim(prepared: Prepared, node: NodePlan) -> NodeClaim:
    """What claiming ``node`` of the plan reads of the loaded job: from the facts the CLI sent
    (a supervisor then never decodes the job's models), else from the job itself."""
    from orchestrate.run.loaded import NodeClaim

    if prepared.facts is not None and node.name in prepared.facts.nodes:
        return prepared.facts.nodes[node.name]
    spec = prepared.inventory.node(node.name)
    return NodeClaim(lease_dir=None if spec is None else spec.lease_dir,
                     is_gpu=spec is not None and spec.is_gpu,
                     gpus=() if spec is None else tuple(g.index for g in spec.gpus),
                     wants=_wants(prepared, node))


def claim_facts(prepared: Prepared) -> ClaimFacts:
    """What a supervisor's claim of this plan reads of the loaded job, for its handshake: the
    CLI has the job decoded; a local supervisor then claims and launches without the spec
    models (:mod:`orchestrate.run.loaded`)."""
    from orchestrate.run.loaded import ClaimFacts

    return ClaimFacts(wait_s=wait_limit(prepared),
                      nodes={n.name: node_claim(prepared, n) for n in prepared.plan.nodes})


def lease_books(prepared: Prepared) -> LeaseBooks | None:
    """The book each node of the plan leases in, for the job's record (None: the backend
    leases in no book)."""
    if not traits(prepared.plan.backend).lease_book:
        return None
    return {node.name: lease_dir(prepared, node.name) for node in prepared.plan.nodes}


def wait_limit(prepared: Prepared) -> float | None:
    """How long the job waits for what others hold (``resources.wait``): None = it does not."""
    if prepared.facts is not None:
        return prepared.facts.wait_s
    # Here, not above: the spec models (pydantic) are the supervisor's slowest import.
    from orchestrate.core.spec.job import wait_seconds

    return wait_seconds(prepared.job.resources.wait)


def wants(prepared: Prepared, node: NodePlan) -> dict[str, Any]:
    """What the job may take on ``node`` were nothing held: its candidate GPUs (every model it
    may be placed on), its CPU slots, its fixed port."""
    return dict(node_claim(prepared, node).wants)


def _wants(prepared: Prepared, node: NodePlan) -> dict[str, Any]:
    plan = prepared.plan
    spec = prepared.inventory.node(node.name)
    loaded = prepared.loaded
    need = placement_need(prepared.job, model_facts(prepared.job, loaded.model,
                                                    loaded.param_count, str(prepared.path)))
    gpus = list(wanted_gpus(prepared.job, spec, need)) if spec is not None else []
    return {"gpus": gpus, "slots": 0 if node.gpu_indices else node.nproc,
            "port": plan.master_port if plan.port_fixed and node.node_rank == 0 else None}


def ticket(prepared: Prepared, node: NodePlan, submitted_at: float, holder: int,
           start: int | None) -> Ticket:
    """A waiting job's place in ``node``'s queue (``holder`` 0: the host fills in who holds
    it there)."""
    uid = os.geteuid()
    want = wants(prepared, node)
    return Ticket(job_id=prepared.plan.job_id, uid=uid, submitted_at=submitted_at,
                  user=user_name(uid), hostname=socket.gethostname(),
                  gpus=sorted(set(want["gpus"])), slots=int(want["slots"]), port=want["port"],
                  holders=[(holder, start)] if holder else [], since=time.time())


def occupancy(node: str, held: Mapping[str, Any], outside: Mapping[str, Mapping[str, Any]],
              sick: Mapping[int, str] | None = None) -> dict[str, Any]:
    """``Occupancy`` fields for one node from the book's ``held``, the GPUs in use outside
    orchestrate (:func:`orchestrate.hostside.gpuuse.outside_use`) and the GPUs that failed
    their health check (:meth:`orchestrate.core.gpuhealth.HostHealth.sick`); empty ones left
    out."""
    fields: dict[str, Any] = {}
    if sick:
        fields["sick"] = {node: {int(k): str(v) for k, v in sick.items()}}
    gpus = frozenset(int(g) for g in held.get("gpus") or [])
    if gpus:
        fields["busy_gpus"] = {node: gpus}
        fields["holders"] = {node: {int(k): str(v) for k, v in (held.get("who") or {}).items()}}
    slots = int(held.get("slots") or 0)
    if slots:
        fields["busy_slots"] = {node: slots}
        fields["slot_holders"] = {node: str(held.get("slot_who") or "")}
    if outside:
        fields["in_use"] = {node: {int(k): str(v["why"]) for k, v in outside.items()}}
        fields["free_gb"] = {node: {int(k): float(v["free_gb"] or 0.0)
                                    for k, v in outside.items()}}
    return fields


#: ``ORCHESTRATE_GPU_HEALTH=off`` skips the GPU health check before a launch (for a
#: comparison, as bench/gpu_health.py makes; the doctor's health tier still runs it).
HEALTH_VAR = "ORCHESTRATE_GPU_HEALTH"


def health_on() -> bool:
    """Whether launches check their GPUs' health first (on unless turned off)."""
    return os.environ.get(HEALTH_VAR, "").strip().lower() not in ("off", "0", "no", "false")


def host_health(facts: Mapping[str, Any] | None, expected: tuple[int, ...]) -> HostHealth:
    """The verdict on one host's GPUs from what :func:`orchestrate.hostside.gpuhealth.gather`
    found there (None: not checked)."""
    return judge(facts or {"status": "missing"}, expected)


def blocked(held: Mapping[str, Any], queue: list[str], source: str) -> UserError | None:
    """A refusal (exit 75) for what no re-plan avoids: a lease that cannot be read (honoured as
    holding everything; the book's report is bounded) or older waiting jobs that want the same
    things (the first few named, then a count)."""
    if held.get("unknown"):
        return UserError.single("; ".join(held["unknown"]), source=source, field="leases",
                                hint="its owner (or root) can remove the file", busy=True)
    jobs = [line for line in queue if not line.startswith("policy ")]
    rules = [line for line in queue if line.startswith("policy ")]
    if jobs or rules:
        said = [f"place {len(jobs) + 1} in the queue: {len(jobs)} job(s) ahead of it want the "
                "same GPUs or slots: " + "; ".join(summary(jobs, "the queue"))] if jobs else []
        return UserError.single(
            "; ".join([*said, *rules]), source=source, field="resources", busy=True,
            hint=QUEUE_HINT)
    return None


#: What a waiting job is told about the order of the queue.
QUEUE_HINT = ("waiting jobs go by their owners' recent use, then by age (orchestrate queue "
              "shows the order; submit --wait joins it)")


def waiting_reason(exc: UserError) -> str:
    """What a waiting job waits for, from the refusal that made it wait."""
    return "waiting: " + "; ".join(p.message for p in exc.problems)


#: How often a running local job looks for other users' processes on its GPUs.
FOREIGN_POLL_S = float(os.environ.get("ORCHESTRATE_FOREIGN_POLL_S") or 30.0)


def foreign_gpu_use(job_id: str, lease_dir: str | None) -> dict[int, str]:
    """What the job's owner is told about this machine's GPUs that the job leases and another
    user's process uses too, by pid: "GPU 3 of your job is also used by pid 4242 (ben, python
    train.py, 12.0 GB)"."""
    from orchestrate.hostside.gpuuse import told, usage
    from orchestrate.hostside.leases import LeaseBook

    try:
        lease = LeaseBook(lease_dir).own(job_id)
    except (BookError, OSError):
        return {}
    if lease is None or not lease.gpus:
        return {}
    return told(usage(), lease)


class ForeignWatch:
    """Another user's processes on a running job's GPUs, as its watchers (the local
    supervisor's thread, each SSH host's agent) see them: each process named once in the job's
    log, the current list in the run directory for ``status``, and all of an attempt's in its
    ending, so a job whose GPUs were shared never ends COMPLETED without saying so."""

    def __init__(self, path: Path, log: Callable[[str], None]) -> None:
        self.path = path
        self.log = log
        self.now: dict[str, dict[int, str]] = {}  # by host ("" on the local machine)
        self.seen: dict[tuple[str, int], str] = {}  # this attempt's, by host and pid
        self.lock = threading.Lock()

    def update(self, where: str, uses: Mapping[int, str]) -> None:
        """What a watcher sees now on host ``where`` ("": this machine)."""
        prefix = f"on {where}: " if where else ""
        with self.lock:
            for pid, line in sorted(uses.items()):
                if (where, pid) not in self.seen:
                    self.log(prefix + line)
                self.seen[(where, pid)] = prefix + line
            if self.now.get(where, {}) == dict(uses):
                return
            self.now[where] = dict(uses)
            lines = [(f"on {host}: " if host else "") + line
                     for host, found in sorted(self.now.items())
                     for _, line in sorted(found.items())]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with contextlib.suppress(OSError):
                tmp.write_text(json.dumps(lines))
                tmp.replace(self.path)

    def ending(self) -> str | None:
        """The words an attempt's ending gets when its GPUs were shared (then forgotten: the
        next attempt starts afresh)."""
        with self.lock:
            lines, self.seen = list(self.seen.values()), {}
        if not lines:
            return None
        more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
        return ("another user's process used its GPUs too: "
                + "; ".join(lines[:5]).replace(" is also used ", " was also used ") + more)
