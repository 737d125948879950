"""The Slurm allocation a plan asks for, and where each of its ranks lands in it. Pure.

The sbatch template only lays out what this module decides: the ``#SBATCH`` options (every value
checked here, quoted there), which host runs each plan node, and each rank's and node's
environment. A plan Slurm cannot honour is refused here, before anything is queued: nodes from
different partitions or GRES types, a stop signal that would fire as soon as the job starts, an
option that is not one.

Placement: the job runs one ``srun`` step for all ranks with ``--distribution=arbitrary`` and a
host file listing each rank's host in rank order, so rank *r* runs on the host of its plan node
whatever order Slurm lists the hosts in. Plan node *i* is the node the job names
(``resources.node_names``), else the *i*-th host of the allocation (uniform layouts), else the
host Slurm gave a matching task count (uneven layouts, matched most ranks first).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from orchestrate.core.errors import UserError
from orchestrate.core.plan.container import ContainerPlan
from orchestrate.core.plan.launch import (
    MASTER_ADDR_WORD,
    MASTER_PORT_WORD,
    TORCHRUN,
    environment_bin,
    not_found,
)
from orchestrate.core.plan.plan import NodePlan, Plan, checkpoint_dir
from orchestrate.core.spec.job import time_limit_seconds

#: Set at run time by the batch script: the first host and a port derived from the Slurm job id.
RUNTIME_ENV = ("MASTER_ADDR", "MASTER_PORT")
#: Slurm sets the GPUs it allocated; the inventory's CUDA indices do not apply inside a job.
SLURM_OWNED_ENV = ("CUDA_VISIBLE_DEVICES",)

_OPTION = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*$")


@dataclass(frozen=True)
class RankSlot:
    """One rank: its numbers and the index of its plan node (its host in the allocation)."""

    rank: int
    local_rank: int
    node_index: int


@dataclass(frozen=True)
class NodeSlot:
    """One plan node as the script sees it."""

    index: int
    name: str
    env: dict[str, str]
    command: tuple[str, ...]
    container: ContainerPlan | None = None  # its podman/docker container (docs/containers.md)
    shell_command: str = ""  # the command as shell words (a torchrun master filled in then)
    bin: str | None = None  # the node's Python environment, where commands are looked up first
    missing: str = ""  # what the task says when its command is not found


Option = tuple[str, "str | None"]  # ("--nodes", "2"); ("--requeue", None) for a flag


@dataclass(frozen=True)
class SlurmLayout:
    """Everything the sbatch template lays out, decided from the plan."""

    options: tuple[Option, ...]  # one #SBATCH line each; the template quotes the values
    pinned_hosts: tuple[str, ...] | None  # host of each plan node when the job names them
    match_order: tuple[int, ...]  # plan nodes, most ranks first: the order hosts are matched in
    nodes: tuple[NodeSlot, ...]
    ranks: tuple[RankSlot, ...]
    #: The step's tasks: every rank, or (a launcher per node) one per node, recorded and
    #: logged under its node's first rank.
    tasks: tuple[RankSlot, ...]
    common_env: dict[str, str]
    python: str  # the first node's interpreter, for the log merger in the batch shell
    signal: str
    max_restarts: int
    requeue_on_node_failure: bool
    policy: str  # the restart policy as JSON, for monitor.py decide
    checkpoint_dir: str  # where the trainer checkpoints ("" for a command job)
    expects_progress: str  # "1" when training writes progress markers (the trainer), else "0"
    watch: str | None = None  # the stall watch's settings as JSON (monitor.py watch), or None
    gpus: bool = False  # the plan asks for GPUs: the job's first step checks their health

    @property
    def world_size(self) -> int:
        """Number of ranks (= tasks of the step)."""
        return len(self.ranks)


def requeued_by_slurm(plan: Plan) -> bool:
    """Whether the job is submitted ``--requeue``: Slurm requeues a job whose node failed by
    itself when allowed to, and the restart policy says whether it is."""
    return "node_lost" in plan.restart.on and plan.restart.max > 0


def slurm_layout(plan: Plan) -> SlurmLayout:
    """The layout of ``plan`` as one Slurm job.

    Raises :class:`UserError` for a plan that one Slurm job cannot run as planned.
    """
    slurm = plan.slurm
    nodes = plan.nodes
    pinned = slurm.nodelist is not None
    counts = [n.nproc for n in nodes]
    requeue = requeued_by_slurm(plan)
    options = _sbatch_options(plan, requeue)
    node_slots = tuple(
        NodeSlot(
            index=i,
            name=n.name,
            env={k: v for k, v in n.env.items() if k not in SLURM_OWNED_ENV},
            command=n.command,
            container=n.container,
            shell_command=shell_command(plan, n),
            bin=environment_bin(n.python),
            missing=not_found(n.command[0], n.python),
        )
        for i, n in enumerate(nodes)
    )
    ranks = tuple(
        RankSlot(rank=r.rank, local_rank=r.local_rank, node_index=r.node_rank) for r in plan.ranks
    )
    tasks = tuple(RankSlot(rank=n.first_rank, local_rank=0, node_index=i)
                  for i, n in enumerate(nodes)) if plan.per_node else ranks
    common = {k: v for k, v in plan.env.items() if k not in RUNTIME_ENV + SLURM_OWNED_ENV}
    return SlurmLayout(
        options=tuple(options),
        pinned_hosts=tuple(n.name for n in nodes) if pinned else None,
        match_order=tuple(sorted(range(len(nodes)), key=lambda i: -counts[i])),
        nodes=node_slots,
        ranks=ranks,
        tasks=tasks,
        common_env=common,
        python=nodes[0].python,
        signal=slurm.signal,
        max_restarts=plan.restart.max,
        requeue_on_node_failure=requeue,
        policy=json.dumps(plan.restart.to_json(), separators=(",", ":")),
        checkpoint_dir=checkpoint_dir(plan) or "",
        expects_progress="1" if plan.train_config is not None else "0",
        watch=_watch_settings(plan),
        gpus=any(n.gpu_indices for n in nodes),
    )


def _sbatch_options(plan: Plan, requeue: bool) -> list[Option]:
    """The job's ``#SBATCH`` lines: its size, where and how long it runs, its signal and
    requeue, then the job's own ``slurm.extra_args``; every one checked printable."""
    slurm = plan.slurm
    options = _size_options(plan)
    partition = _one_of(
        "partition", [n.partition for n in plan.nodes], "slurm.partition",
        "set slurm.partition, or name nodes of one partition in resources.node_names",
    )
    if partition:
        options.append(("--partition", partition))
    if slurm.account:
        options.append(("--account", slurm.account))
    if slurm.qos:
        options.append(("--qos", slurm.qos))
    if slurm.nodelist is not None:
        options.append(("--nodelist", slurm.nodelist))
    _check_signal_time(plan.time_limit, slurm.signal_seconds_before)
    # Without "B:" Slurm signals every process of the job's steps (the ranks), not the batch
    # shell; the ranks checkpoint and exit 75, and the batch script requeues the job.
    options.append(("--signal", f"{slurm.signal}@{slurm.signal_seconds_before}"))
    if requeue:
        options.append(("--requeue", None))
    else:
        options.append(("--no-requeue", None))
    options.append(("--open-mode", "append"))
    options += _extra_args(slurm.extra_args)
    for option, given in options:
        _check_printable(option if given is None else f"{option}={given}")
    return options


def _size_options(plan: Plan) -> list[Option]:
    """Nodes, tasks, GPUs, CPUs, memory and time."""
    slurm = plan.slurm
    counts = [n.nproc for n in plan.nodes]
    options: list[Option] = [("--job-name", plan.job_name), ("--nodes", str(len(plan.nodes)))]
    if plan.uniform:
        options.append(("--ntasks-per-node", str(counts[0])))
    else:
        # Slurm allocates the same number of CPUs on every node of a job; the step then starts
        # exactly each node's count (the smaller nodes keep a few allocated CPUs idle).
        options += [("--ntasks", str(plan.world_size)), ("--ntasks-per-node", str(max(counts)))]
    gpu_options = _gpu_options(plan)
    if plan.uniform and any(name == "--gpus-per-task" for name, _ in gpu_options):
        options.append(("--ntasks", str(plan.world_size)))  # 23.11 refuses it without
    options += gpu_options
    if slurm.cpus_per_task:
        options.append(("--cpus-per-task", str(slurm.cpus_per_task)))
    if slurm.mem:
        options.append(("--mem", slurm.mem))
    if plan.time_limit:
        options.append(("--time", plan.time_limit))
    return options


def _extra_args(extra_args: tuple[str, ...]) -> list[Option]:
    """``slurm.extra_args``, one sbatch option each (``--name=value`` or ``--flag``)."""
    options: list[Option] = []
    for i, arg in enumerate(extra_args):
        name, sep, value = arg.partition("=")
        if not _OPTION.match(name):
            raise UserError.single(
                "each item is one sbatch option", field=f"slurm.extra_args.{i}", got=arg,
                hint="write '--constraint=a100', not '--constraint', 'a100'",
            )
        options.append((name, value if sep else None))
    return options


def shell_command(plan: Plan, node: NodePlan) -> str:
    """A node's command as shell words for ``set --``: every word quoted, except a torchrun
    line's master address and port, which the batch script knows only when it runs (the first
    host, the port from the Slurm job id) unless the job fixed them."""
    from orchestrate.core.render.render import quote

    words = [quote(arg) for arg in node.command]
    if plan.launcher == TORCHRUN:
        if not plan.master_addr_fixed:
            words[MASTER_ADDR_WORD] = '--master-addr="$MASTER_ADDR"'
        if not plan.port_fixed:
            words[MASTER_PORT_WORD] = '--master-port="$MASTER_PORT"'
    return " ".join(words)


def _watch_settings(plan: Plan) -> str | None:
    """What ``monitor.py watch`` needs, unless the job turned the sidecar off: the stall
    watch's bound (0: off) and the plan's world, which the ranks' process groups must match."""
    if not plan.sidecar:
        return None
    settings: dict[str, object] = {
        "stall_s": plan.stall_s,
        "busy_s": plan.busy_s,
        "heartbeat_s": plan.heartbeat_s,
        "on_stall": plan.on_stall,
        "interface": plan.nodes[0].env.get("GLOO_SOCKET_IFNAME"),
        "world_size": plan.world_size,
        "launcher": plan.launcher,
        "on_wrong_world": plan.on_wrong_world,
        "timeout_s": plan.timeout_s,  # the bound of ranks hung in their exit (run/linger.py)
    }
    if plan.per_node:  # the host file has a line per node: each rank's node, by index
        settings["rank_nodes"] = [r.node_rank for r in plan.ranks]
    return json.dumps(settings, separators=(",", ":"))


def _gpu_options(plan: Plan) -> list[Option]:
    gpus = [len(n.gpu_indices) for n in plan.nodes]
    if not any(gpus):
        return []
    gres_type = _one_of(
        "GRES type", [n.gres_type for n in plan.nodes], "slurm.gres_type",
        "set slurm.gres_type, or choose nodes of one GPU type",
    )
    typed = f"{gres_type}:" if gres_type else ""
    if len(set(gpus)) == 1:
        if gres_type:
            return [("--gres", f"gpu:{typed}{gpus[0]}")]
        return [("--gpus-per-node", str(gpus[0]))]
    # Different GPU counts per node (3 + 2): one GPU per task, so that Slurm allocates each node
    # the GPUs of its tasks; the script matches hosts to plan nodes by their task counts, and
    # every task of a node sees all of that node's GPUs (cuda:LOCAL_RANK).
    return [("--gpus-per-task", f"{typed}1"), ("--gpu-bind", "none")]


def _one_of(what: str, values: list[str | None], field: str, hint: str) -> str | None:
    distinct = sorted({v for v in values if v})
    if len(distinct) > 1:
        raise UserError.single(
            f"the plan's nodes have different {what}s ({', '.join(distinct)}); "
            "one Slurm job has one",
            field=field, hint=hint,
        )
    return distinct[0] if distinct else None


#: Slurm may send the stop signal up to a minute before it is due (it checks on a cadence).
SIGNAL_SLACK_S = 60


def _check_signal_time(limit: str | None, before: int) -> None:
    if limit is None:
        return
    seconds = time_limit_seconds(limit)
    if seconds - before < SIGNAL_SLACK_S:
        raise UserError.single(
            f"the stop signal would be sent {before}s before a time limit of {seconds}s, "
            f"less than {SIGNAL_SLACK_S}s after the job starts (Slurm may send it up to "
            f"{SIGNAL_SLACK_S}s early): every run would be stopped almost at once and requeued",
            field="slurm.signal_seconds_before", got=before,
            hint=f"keep it at most {max(1, seconds - SIGNAL_SLACK_S)}s for this time limit, "
            "or raise resources.time",
        )


def _check_printable(option: str) -> None:
    if not option.isprintable():
        raise UserError.single(
            "line breaks and control characters cannot go into an #SBATCH line",
            field="slurm", got=option,
        )
