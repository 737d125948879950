"""Host facts through Slurm: the controller's node records, plus one short task per node.

``inventory probe --slurm`` and ``inventory check`` (for an inventory's Slurm nodes) use it.

- What Slurm knows comes from ``scontrol show node`` (:func:`cluster_nodes`): name,
  address, CPUs, memory, GRES, state, partitions. The key=value form is read rather than
  ``--json``: it is the same on every Slurm release, while the JSON's layout follows the
  release's data_parser version (and needs Slurm built with JSON support).
- Nodes Slurm will not run a task on now (down, drained or draining, failing, not responding,
  powered down, in maintenance, or with every CPU allocated) are reported with Slurm's state
  and reason and not probed (:func:`blocker`).
- What only the node knows comes from one ``srun`` per partition (and interpreter), one task
  per node, running the facts program of :mod:`orchestrate.probe.gathering`. It is bounded three
  ways: ``--immediate`` (a busy partition fails it at once instead of queueing it), ``--time``
  (Slurm ends it), and a deadline here after which srun is stopped (SIGTERM, which cancels the
  step, then SIGKILL). Each task's facts name their node (``SLURMD_NODENAME``); the output of
  a task that failed is told apart by ``--label`` and srun's ``task N`` error lines.
- Slurm's CPU count replaces the task's own (a task sees only the CPUs it was given).

:func:`gather_cluster` is ``probe --slurm`` (chosen nodes, one srun per partition, each node
written with its partition and GRES type); :func:`gather_inventory_nodes` is ``check`` for an
inventory's Slurm nodes (in their partition, with their python).
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from orchestrate.backends.slurm.ctl import SlurmClient, SlurmError, parse_show_node
from orchestrate.core.errors import UserError
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.inventory import Node
from orchestrate.probe.gathering import (
    DEFAULT_PYTHON,
    Gathered,
    Unreachable,
    facts_argv,
    failure,
    peers_of,
    read_split_facts,
)

#: Seconds srun may wait for its nodes before giving up (``--immediate``).
QUEUE_S = 30
#: How long srun gets to cancel its step after SIGTERM.
STOP_GRACE_S = 5.0
#: Base states and flags under which Slurm starts no new task on a node.
_NOT_RUNNING = {
    "DOWN": "down", "FUTURE": "not in service yet", "UNKNOWN": "in an unknown state",
    "ERROR": "in an error state",
}
_FLAGS = {
    "DRAIN": "drained", "DRAINING": "draining", "DRAINED": "drained", "FAIL": "failing",
    "FAILING": "failing", "NOT_RESPONDING": "not responding", "POWERED_DOWN": "powered down",
    "POWER_DOWN": "powering down", "POWERING_DOWN": "powering down",
    "MAINTENANCE": "in maintenance", "MAINT": "in maintenance", "REBOOT_ISSUED": "rebooting",
    "INVALID_REG": "registered with a bad configuration",
}
_LABEL = re.compile(r"^\s*(\d+): (.*)$")
_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.*)$")


@dataclass(frozen=True)
class SlurmNode:
    """One node as ``scontrol show node`` describes it."""

    name: str
    address: str
    hostname: str
    cpus: int | None
    memory_mb: int | None
    gres: str
    state: str
    partitions: tuple[str, ...]
    reason: str | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> SlurmNode:
        """A node from one record of :func:`~orchestrate.backends.slurm.ctl.parse_show_node`."""
        name = record["NodeName"]
        partitions = tuple(p for p in (record.get("Partitions") or "").split(",") if p)
        reason = record.get("Reason") or None
        return cls(
            name=name,
            address=record.get("NodeAddr") or name,
            hostname=record.get("NodeHostName") or name,
            cpus=_int(record.get("CPUTot")),
            memory_mb=_int(record.get("RealMemory")),
            gres="" if record.get("Gres") in (None, "(null)") else record["Gres"],
            state=record.get("State", "UNKNOWN"),
            partitions=partitions,
            reason=None if reason in (None, "(null)", "none") else reason,
        )

    @property
    def gres_type(self) -> str | None:
        """The type of its GPUs' GRES (``gpu:a100:4(S:0-1)`` -> ``a100``), if it names one."""
        for item in self.gres.split(","):
            words = item.split("(")[0].split(":")
            if words[0] == "gpu" and len(words) == 3 and not words[1].isdigit():
                return words[1]
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def blocker(node: SlurmNode) -> str | None:
    """Why Slurm will not run a probe task on ``node`` now (None: it will)."""
    words = node.state.upper().split("+")
    base = words[0].rstrip("*~#!%$@^-")
    flags = words[1:] + (["NOT_RESPONDING"] if words[0].endswith("*") else [])
    why = [_NOT_RUNNING[base]] if base in _NOT_RUNNING else []
    busy = base in ("ALLOCATED", "MIXED", "COMPLETING")
    why += [("draining" if busy and f == "DRAIN" else _FLAGS[f]) for f in flags
            if f in _FLAGS and _FLAGS[f] not in why]
    if not why and base == "ALLOCATED":
        why.append("busy (every CPU allocated)")
    if not why:
        return None
    reason = f": {node.reason}" if node.reason else ""
    return f"Slurm says {node.state} ({', '.join(why)}{reason}); not probed"


def cluster_nodes(client: SlurmClient) -> list[SlurmNode]:
    """Every node the controller knows; raises :class:`SlurmError` when it cannot be asked."""
    done = client.run("scontrol", "show", "node")  # multi-line: a Reason is whole
    if done.returncode != 0:
        raise SlurmError(done.describe())
    return [SlurmNode.from_record(r) for r in parse_show_node(done.stdout) if "NodeName" in r]


def known_nodes() -> list[SlurmNode]:
    """Every node this machine's Slurm controller knows; a UserError when Slurm cannot be
    asked (no scontrol, no controller, no munge)."""
    try:
        return cluster_nodes(SlurmClient())
    except SlurmError as exc:
        raise UserError.single(f"cannot ask Slurm for its nodes: {exc}", source="slurm",
                               hint="run this where Slurm's commands work (scontrol, srun; "
                                    "SLURM_CONF, munge)") from None


@dataclass(frozen=True)
class Group:
    """Nodes probed by one srun: same partition, same interpreter."""

    nodes: tuple[SlurmNode, ...]
    partition: str | None
    python: str


def gather_through_slurm(
    groups: Sequence[Group],
    *,
    bound_s: float,
    torch: bool = True,
    import_torch: bool = False,
    queue_s: float = QUEUE_S,
    env: Mapping[str, str] | None = None,
) -> dict[str, Gathered]:
    """Facts (or why not) for every node of ``groups``, by node name; one srun per group, all
    at once. Nodes :func:`blocker` refuses are reported without asking Slurm for them."""
    gathered: dict[str, Gathered] = {}
    runnable: list[Group] = []
    for group in groups:
        ready = tuple(n for n in group.nodes if blocker(n) is None)
        for node in group.nodes:
            why = blocker(node)
            if why is not None:
                gathered[node.name] = Unreachable(why)
        if ready:
            runnable.append(Group(ready, group.partition, group.python))
    if runnable:
        with ThreadPoolExecutor(max_workers=len(runnable)) as pool:
            for found in pool.map(lambda g: _run_group(g, bound_s, torch, import_torch,
                                                       queue_s, env), runnable):
                gathered.update(found)
    order = [n.name for g in groups for n in g.nodes]
    return {name: gathered[name] for name in order}


def srun_argv(group: Group, program_argv: Sequence[str], bound_s: float, queue_s: float,
              import_torch: bool) -> list[str]:
    """``srun ... PYTHON -S -c PROGRAM ...``: one task on each node of the group."""
    n = len(group.nodes)
    minutes = max(1, math.ceil((bound_s + queue_s) / 60) + 1)
    argv = [
        "srun", "--job-name=orchestrate-probe", f"--nodes={n}", f"--ntasks={n}",
        "--ntasks-per-node=1", "--cpus-per-task=1", f"--mem={'2G' if import_torch else '256M'}",
        f"--nodelist={hostlist.compress([node.name for node in group.nodes])}",
        f"--time={minutes}", f"--immediate={max(1, math.ceil(queue_s))}", "--label",
        "--kill-on-bad-exit=0", "--quiet",
    ]
    if group.partition:
        argv.append(f"--partition={group.partition}")
    return [*argv, *program_argv]


def _run_group(group: Group, bound_s: float, torch: bool, import_torch: bool, queue_s: float,
               env: Mapping[str, str] | None) -> dict[str, Gathered]:
    peers = peers_of([node.address for node in group.nodes], None)  # one argv for all tasks
    program = facts_argv(group.python, peers, bound_s=bound_s, torch=torch,
                         import_torch=import_torch)
    argv = srun_argv(group, program, bound_s, queue_s, import_torch)
    deadline = queue_s + bound_s + 30
    code, out, err = _run(argv, deadline, env)
    return read_tasks(group, code, out, err, bound_s, deadline)


def _run(argv: list[str], timeout: float, env: Mapping[str, str] | None
         ) -> tuple[int | None, str, str]:
    """srun's exit status (None: stopped here after ``timeout``), stdout and stderr."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=None if env is None else dict(env))
    except OSError as exc:
        return 127, "", f"{argv[0]}: {exc.strerror}"
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # srun cancels the step and gives the nodes back
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return None, out, err


def read_tasks(group: Group, code: int | None, out: str, err: str, bound_s: float,
               deadline_s: float) -> dict[str, Gathered]:
    """Each node's facts from srun's labelled output, or why there are none."""
    pieces = _labelled(out)
    said_by_task = _labelled(out + "\n" + err)
    names = {n.name for n in group.nodes}
    hostnames = {n.hostname: n.name for n in group.nodes}
    found: dict[str, Gathered] = {}
    for task_pieces in pieces.values():
        facts = read_split_facts(task_pieces)
        if facts is None:
            continue
        node = facts.get("slurm_node") or hostnames.get(str(facts.get("hostname")))
        if node in names:
            found[str(node)] = _with_slurm_cpus(facts, group, str(node))
    task_errors: dict[str, tuple[int | None, str]] = {}
    srun_said: list[str] = []
    for line in err.splitlines():
        error = _TASK_ERROR.match(line.strip())
        if error and error.group(1) in names:
            status = re.search(r"exit code (\d+)", error.group(3))
            task = _first_task(error.group(2))
            said = "\n".join(said_by_task.get(task, [])) if task is not None else ""
            task_errors[error.group(1)] = (int(status.group(1)) if status else None, said)
        elif line.strip() and not _LABEL.match(line):
            srun_said.append(line.strip())
    for node in group.nodes:
        if node.name in found:
            continue
        if node.name in task_errors:
            exit_code, said = task_errors[node.name]
            found[node.name] = Unreachable(failure(group.python, exit_code, said, bound_s))
        elif code is None:
            found[node.name] = Unreachable(
                f"srun gave no answer within {deadline_s:g}s (stopped)"
                + (f": {' | '.join(srun_said[-3:])}" if srun_said else ""))
        else:
            tail = " | ".join(srun_said[-3:])[-400:] or f"exit status {code}"
            found[node.name] = Unreachable(f"srun could not run the probe here: {tail}")
    return found


def _labelled(text: str) -> dict[int, list[str]]:
    """srun ``--label`` output: each task's pieces, in order."""
    by_task: dict[int, list[str]] = {}
    for line in text.splitlines():
        labelled = _LABEL.match(line)
        if labelled:
            by_task.setdefault(int(labelled.group(1)), []).append(labelled.group(2))
    return by_task


def _first_task(spec: str) -> int | None:
    found = re.match(r"\d+", spec)
    return int(found.group(0)) if found else None


def _with_slurm_cpus(facts: Mapping[str, Any], group: Group, name: str) -> dict[str, Any]:
    """The task's facts with the node's CPU count from Slurm (the task sees only its own)."""
    node = next(n for n in group.nodes if n.name == name)
    out = dict(facts)
    if node.cpus:
        out["cpus"] = {**(facts.get("cpus") or {}), "count": node.cpus, "usable": node.cpus,
                       "task": (facts.get("cpus") or {}).get("usable")}
    out["slurm"] = {"partition": group.partition, "state": node.state, "gres": node.gres}
    return out


# ------------------------------------------------------------------------ what probe and check do


def gather_cluster(nodes: Sequence[SlurmNode], partition: str | None, python: str | None, *,
                   bound_s: float, torch: bool = True, import_torch: bool = False
                   ) -> tuple[dict[str, Gathered], dict[str, dict[str, Any]]]:
    """``probe --slurm``: facts for ``nodes``, one srun per partition (``partition``, else each
    node's first), and what the written file keeps of each node: its partition and GRES type
    under ``slurm:``."""
    by_partition: dict[str | None, list[SlurmNode]] = {}
    for node in nodes:
        chosen = partition or (node.partitions[0] if node.partitions else None)
        by_partition.setdefault(chosen, []).append(node)
    groups = [Group(tuple(members), part, python or DEFAULT_PYTHON)
              for part, members in by_partition.items()]
    gathered = gather_through_slurm(groups, bound_s=bound_s, torch=torch,
                                    import_torch=import_torch)
    extras: dict[str, dict[str, Any]] = {}
    for group in groups:
        for node in group.nodes:
            slurm = {k: v for k, v in (("partition", group.partition),
                                       ("gres_type", node.gres_type)) if v is not None}
            extras[node.name] = {"slurm": slurm}
    return gathered, extras


def gather_inventory_nodes(nodes: Sequence[Node], *, bound_s: float, torch: bool = True,
                           import_torch: bool = False) -> dict[str, Gathered]:
    """Inventory nodes probed through Slurm: one srun per partition and python (a node Slurm
    does not know is Unreachable, with why)."""
    known = {n.name: n for n in known_nodes()}
    gathered: dict[str, Gathered] = {}
    grouped: dict[tuple[str | None, str], list[SlurmNode]] = {}
    for node in nodes:
        found = known.get(node.name)
        if found is None:
            gathered[node.name] = Unreachable("Slurm has no node of this name (`sinfo -N`)")
            continue
        partition = node.partition or (found.partitions[0] if found.partitions else None)
        grouped.setdefault((partition, node.python or DEFAULT_PYTHON), []).append(found)
    groups = [Group(tuple(members), partition, python)
              for (partition, python), members in grouped.items()]
    if groups:
        gathered.update(gather_through_slurm(groups, bound_s=bound_s, torch=torch,
                                             import_torch=import_torch))
    return gathered
