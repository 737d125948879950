"""Preflight: what to ask each host, how to judge the answers against the plan, and the table.

Each host answers every question in one request to its agent (one remote program, so a host
costs one login): does the node's python run (it runs the agent) and import torch, does the
working directory exist, which of the candidate master ports are free on the master host (its
own port space, not the controller's), whether MASTER_ADDR resolves there, which interface
carries traffic to MASTER_ADDR, which
GPUs nvidia-smi shows, and which GPUs and ports other jobs' leases hold there.

Judging is pure: the same facts are judged again after a re-plan (other GPUs, another port).
Across hosts, every host that imports torch must import the same version (a mix hangs or
fails in the first collective, with no clear error).
A failed check is named per host (:func:`host_table`); a busy derived port or GPUs held by other
jobs are not failures but inputs to the re-plan.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrate.backends.hosttable import HostRow, HostTable
from orchestrate.backends.sharing import health_on, host_health, occupancy
from orchestrate.backends.ssh.connections import Target
from orchestrate.backends.ssh.facts import ClaimAnswer, HostFacts, LeaseFacts
from orchestrate.backends.ssh.wire import Preflight
from orchestrate.core.errors import Problem
from orchestrate.core.plan.plan import NodePlan, Plan
from orchestrate.core.plan.ports import pick_port

#: Columns of the table, in order. "ssh" covers reaching the host, its key and the login.
CHECKS = ("ssh", "python", "torch", "workdir", "master", "port", "gpus", "interface", "leases")
#: Master ports asked about at once when the derived one may be busy.
PORT_CANDIDATES = 64

HINTS = {
    "ssh": "check the address, that sshd runs there, and the inventory's ssh settings",
    "host key": "",
    "login": "check ssh.user and ssh.identity_file in the inventory, or your ssh-agent",
    "python": "set the node's python in the inventory (an absolute path to an interpreter)",
    "torch": "install torch for that interpreter (the same version on every host), or point the "
             "inventory's python at one with it",
    "workdir": "create it on the host (SSH jobs do not copy your code), or set the job's workdir",
    "master": "every node must resolve and reach MASTER_ADDR (rank 0's node's address): give "
              "that node an 'address:' in the inventory that every node resolves (an IP, or a "
              "name in their DNS), or open the master port between the nodes",
    "port": "choose another distributed.master_port, or 'auto' to have one picked",
    "gpus": "check the inventory's CUDA indices (PCI bus order) against nvidia-smi on the host",
    "interface": "set network.interface for the node in the inventory",
    "leases": "the host's shared lease book (/var/tmp/orchestrate/leases, or the node's "
              "lease_dir) must be usable by every user: see docs/shared-servers.md",
}


@dataclass
class HostAnswer:
    """One host's preflight: the agent's answer, or the step that failed before it."""

    target: Target
    facts: HostFacts | None = None
    failed: str | None = None  # "ssh", "host key", "login" or "python"
    detail: str = ""

    def keep_torch(self, known: HostAnswer | None) -> None:
        """Asked again without ``import torch`` (it worked before), keep what the host said
        then: its version is compared with the other hosts'."""
        torch = known.facts.torch if known is not None and known.facts is not None else None
        if self.facts is not None and self.facts.torch is None and torch is not None:
            self.facts = replace(self.facts, torch=torch)

    def taken(self, reply: ClaimAnswer, port: int) -> HostAnswer:
        """These facts with what a refused claim says the others hold now (for the
        re-plan)."""
        facts = self.facts
        if facts is None:
            return self
        ports = facts.ports
        if reply.port_taken and ports is not None:
            ports = replace(ports, free=[p for p in ports.free if p != port])
        leases = replace(facts.leases, gpus=reply.busy_gpus, slots=reply.busy_slots,
                         ports=reply.busy_ports)
        return replace(self, facts=replace(facts, leases=leases, ports=ports))


@dataclass
class Judgement:
    """The facts judged against one plan."""

    cells: dict[str, dict[str, str]] = field(default_factory=dict)  # host -> check -> text
    failures: list[tuple[Target, str, str]] = field(default_factory=list)  # host, check, why
    busy_gpus: dict[str, frozenset[int]] = field(default_factory=dict)
    busy_slots: dict[str, int] = field(default_factory=dict)  # CPU slots other jobs hold
    #: Occupancy's other fields, by node: GPUs in use outside orchestrate (why, free GB), who
    #: holds the leased GPUs and slots.
    sharing: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What the GPU health check said per host: sick GPUs, warnings, what it could not check.
    health: dict[str, list[str]] = field(default_factory=dict)
    #: Busy for a reason no re-plan avoids: older waiting jobs, unreadable leases, by host.
    waits: dict[str, list[str]] = field(default_factory=dict)
    port: int | None = None  # a free port to re-plan with, when the planned one is busy
    interfaces: dict[str, str] = field(default_factory=dict)
    replan: bool = False  # the plan uses held GPUs or a busy port, or lacks an interface

    @property
    def ok(self) -> bool:
        """No check failed."""
        return not self.failures


def uses_python(node: NodePlan) -> bool:
    """Whether the node's command starts with the node's python (the training entrypoint
    always does): then ``import torch`` must work there."""
    return bool(node.command) and node.command[0] == node.python


def orchestrate_module(plan: Plan, node: NodePlan) -> str | None:
    """The orchestrate module the node's python must import, if its command runs one: the
    training entrypoint (``train:`` jobs), or ``python -m orchestrate.X`` (the doctor's checkup).
    A host that cannot is the one named, not every host after the job fails."""
    if plan.train_config is not None:
        return "orchestrate.train"
    argv = node.command
    if uses_python(node) and len(argv) > 2 and argv[1] == "-m" and \
            _MODULE.fullmatch(argv[2]) and argv[2].split(".")[0] == "orchestrate":
        return argv[2]
    return None


def candidate_ports(plan: Plan) -> list[int]:
    """The planned port, then (for a derived one) the next ports :func:`pick_port` would try."""
    if plan.port_fixed:
        return [plan.master_port]
    order: list[int] = []

    def record(port: int) -> bool:
        order.append(port)
        return len(order) >= PORT_CANDIDATES

    pick_port(plan.master_port, (), record)
    return order


def request(plan: Plan, node: NodePlan, discover: bool, torch_known_ok: bool,
            lease_dir: str | None = None, want: dict[str, Any] | None = None) -> Preflight:
    """The preflight request for one node of ``plan`` (the host's ``lease_dir`` and what the
    job ``want``s there, for the queue)."""
    return Preflight(
        job_id=plan.job_id,
        workdir=plan.workdir,
        torch=uses_python(node) and not torch_known_ok,
        orchestrate=orchestrate_module(plan, node),
        pythonpath={**plan.env, **node.env}.get("PYTHONPATH"),
        python=node.python,
        interface_to=plan.master_addr if discover else None,
        master_addr=plan.master_addr,
        gpus=bool(node.gpu_indices),
        health=bool(node.gpu_indices) and health_on(),
        ports=candidate_ports(plan) if node.node_rank == 0 else [],
        lease_dir=lease_dir,
        want=want,
    )


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

#: Records a failed check: ``fail(check, detail)``.
Fail = Callable[[str, str], None]


def judge(plan: Plan, hosts: Mapping[str, HostAnswer], discover: Iterable[str]) -> Judgement:
    """Judge every host's facts against ``plan``."""
    verdict = Judgement()
    wanted_interface = set(discover)
    for node in plan.nodes:
        host = hosts[node.name]
        cells = verdict.cells.setdefault(node.name, dict.fromkeys(CHECKS, "-"))

        def fail(check: str, detail: str, *, host: HostAnswer = host,
                 cells: dict[str, str] = cells) -> None:
            column = check if check in cells else "ssh"
            cells[column] = detail
            verdict.failures.append((host.target, check, detail))

        if host.facts is None:
            fail(host.failed or "ssh", host.detail)
            continue
        facts = host.facts
        _judge_runtime(facts, cells, fail)
        leases = facts.leases
        _judge_leases(node, leases, cells, fail, verdict)
        sick = _judge_health(node, facts, verdict)
        verdict.sharing[node.name] = occupancy(
            node.name, leases.to_json(), {k: v.to_json() for k, v in facts.gpu_use.items()},
            sick)
        _judge_gpus(node, facts, cells, fail)
        _judge_master(plan, facts, cells, fail)
        if node.name in wanted_interface:
            _judge_interface(plan, node, facts, cells, fail, verdict)
        elif node.env.get("GLOO_SOCKET_IFNAME"):
            cells["interface"] = node.env["GLOO_SOCKET_IFNAME"] + " (inventory)"
        if node.node_rank == 0:
            _judge_port(plan, node, facts, leases, cells, fail, verdict)
    _judge_torch_versions(plan, hosts, verdict)
    return verdict


def _judge_torch_versions(plan: Plan, hosts: Mapping[str, HostAnswer], verdict: Judgement
                          ) -> None:
    """Every host that imported torch runs the same torch (``torch.__version__``, build tag
    included): mixed versions hang or fail in the first collective, with no clear error. The
    odd hosts fail, each naming its version and a host with the others' (the most common one;
    on a tie, the master node's)."""
    versions: dict[str, str] = {}
    for node in plan.nodes:
        facts = hosts[node.name].facts
        torch = facts.torch if facts is not None else None
        if torch is not None and torch.ok:
            versions[node.name] = str(torch.version or torch.detail)
    if len(set(versions.values())) < 2:
        return
    counts = Counter(versions.values())
    most = max(counts.values())
    common = next(v for v in versions.values() if counts[v] == most)  # the master's on a tie
    where = next(name for name, v in versions.items() if v == common)
    for name, version in versions.items():
        if version != common:
            detail = (f"torch {version} here, {common} on {where}: every host must run the "
                      "same torch")
            verdict.cells[name]["torch"] = detail
            verdict.failures.append((hosts[name].target, "torch", detail))


def _judge_runtime(facts: HostFacts, cells: dict[str, str], fail: Fail) -> None:
    """The login worked; the node's python, torch (when asked) and the working directory."""
    cells["ssh"] = "ok"
    cells["python"] = "ok " + facts.python.rsplit(" ", 1)[-1]
    torch = facts.torch
    if torch is not None:
        if torch.ok:
            cells["torch"] = "ok " + str(torch.detail or "")
        else:
            # torch imported (its version came) but the command's orchestrate module did not
            what = "torch" if torch.version is None else "orchestrate"
            fail("torch", f"import {what} failed: {torch.detail}")
    if facts.workdir.ok:
        cells["workdir"] = "ok"
    else:
        fail("workdir", f"{facts.workdir.path} does not exist")


def _judge_leases(node: NodePlan, leases: LeaseFacts, cells: dict[str, str], fail: Fail,
                  verdict: Judgement) -> None:
    """What other jobs hold on the host: GPUs and CPU slots the re-plan must avoid."""
    if leases.error:
        fail("leases", f"lease book unusable: {leases.error}"
             + (f" ({leases.hint})" if leases.hint else ""))
    else:
        queued = len(leases.queue)
        cells["leases"] = f"{len(leases.jobs)} other job(s)" + (
            f", {queued} waiting before it" if queued else "")
    ahead = [w for w in leases.queue if not w.startswith("policy ")]
    waits = [*leases.unknown, *(w for w in leases.queue if w.startswith("policy ")),
             *([f"place {len(ahead) + 1} in the queue, behind " + "; ".join(ahead[:5])]
               if ahead else [])]
    if waits:
        verdict.waits[node.name] = waits
    held = frozenset(leases.gpus)
    if held:
        verdict.busy_gpus[node.name] = held
        if held & set(node.gpu_indices):
            verdict.replan = True
    if leases.slots and not node.gpu_indices:
        verdict.busy_slots[node.name] = leases.slots


def _judge_interface(plan: Plan, node: NodePlan, facts: HostFacts, cells: dict[str, str],
                     fail: Fail, verdict: Judgement) -> None:
    """The interface the host found towards MASTER_ADDR (the inventory names none)."""
    found = facts.interface
    if found is not None and found.ok and found.name:
        verdict.interfaces[node.name] = found.name
        cells["interface"] = found.name
        if node.env.get("GLOO_SOCKET_IFNAME") != found.name:
            verdict.replan = True
    else:
        fail("interface", f"no interface towards {plan.master_addr}: "
                          f"{found.detail if found is not None else 'not answered'}")


def _judge_master(plan: Plan, facts: HostFacts, cells: dict[str, str], fail: Fail
                  ) -> None:
    """MASTER_ADDR resolves on the host (not asked: nothing to judge)."""
    master = facts.master
    if master is None:
        return
    if master.ok:
        cells["master"] = "resolves"
    else:
        fail("master", master.detail or f"MASTER_ADDR {plan.master_addr} does not resolve")


def _judge_health(node: NodePlan, facts: HostFacts, verdict: Judgement) -> dict[int, str]:
    """The host's sick GPUs (index -> why), from its health facts; every line said is kept
    for the supervisor's log."""
    if not facts.gpu_health:
        return {}
    health = host_health(facts.gpu_health, ())
    lines = [*health.notes, *health.warnings(), *health.sick().values()]
    if lines:
        verdict.health[node.name] = lines
    return health.sick()


def _judge_gpus(node: NodePlan, facts: HostFacts, cells: dict[str, str], fail: Fail
                ) -> None:
    if not node.gpu_indices:
        return
    gpus = facts.gpus
    if gpus is None or not gpus.ok:
        fail("gpus", str(gpus.detail if gpus is not None else "not answered"))
        return
    present = {int(gpu[0]) for gpu in gpus.present}
    missing = sorted(set(node.gpu_indices) - present)
    if missing:
        fail("gpus", f"GPU(s) {missing} not present (nvidia-smi shows {sorted(present)})")
    else:
        cells["gpus"] = "ok " + ",".join(map(str, node.gpu_indices))


def _judge_port(
    plan: Plan,
    node: NodePlan,
    facts: HostFacts,
    leases: LeaseFacts,
    cells: dict[str, str],
    fail: Fail,
    verdict: Judgement,
) -> None:
    held = frozenset(leases.ports)
    free = set(facts.ports.free) if facts.ports is not None else set()
    port = plan.master_port
    if port in free and port not in held:
        cells["port"] = f"ok {port}"
        return
    why = "held by another orchestrate job" if port in held else "in use"
    if plan.port_fixed:
        fail("port", f"master port {port} is {why} on {node.name}")
        return
    chosen = pick_port(port, held, lambda p: p in free)
    if chosen is None:
        fail("port", f"no free port among the {PORT_CANDIDATES} tried from {port} on {node.name}")
        return
    verdict.port = chosen
    verdict.replan = True
    cells["port"] = f"ok {chosen} ({port} {why})"


def problems(verdict: Judgement, source: str) -> list[Problem]:
    """One problem per failed check of each host, for
    :class:`~orchestrate.core.errors.UserError`."""
    return [
        Problem(
            f"{target.label}: {check}: {detail}",
            source=source,
            field="preflight",
            hint=HINTS.get(check, ""),
            setup=check == "leases",  # the host's book is unusable: its root fixes it once
        )
        for target, check, detail in verdict.failures
    ]


def host_table(verdict: Judgement, targets: Mapping[str, Target]) -> HostTable:
    """The per-host table of ``verdict``: a row per host, a column per check; a failed check
    that has no column of its own (host key, login) fails the ``ssh`` column."""
    failing: dict[str, set[str]] = {}
    for target, check, _ in verdict.failures:
        failing.setdefault(target.name, set()).add(check if check in CHECKS else "ssh")
    return HostTable("preflight", CHECKS, tuple(
        HostRow(targets[name].label, tuple(cells[c] for c in CHECKS),
                frozenset(failing.get(name, ())))
        for name, cells in verdict.cells.items()))
