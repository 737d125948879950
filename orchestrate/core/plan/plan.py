"""The planner: job + inventory in, a launch plan out. Pure: no files, sockets, clock or dice.

It picks nodes and GPUs (:mod:`orchestrate.core.plan.placement`), numbers every rank
(:mod:`orchestrate.core.plan.ranks`), chooses the master address and port, and computes the
environment of every process (:mod:`orchestrate.core.plan.rankenv`). What cannot work is refused
there, with the
reason, before anything is queued. Everything the backends and templates need is in :class:`Plan`,
typed
down to the backend settings; templates only lay it out.

Facts only a backend can know (what other jobs hold on a host, a port found free there, the
interface towards the master) come in as an :class:`Occupancy` value, so a backend re-plans by
calling :func:`make_plan` again with what it found.

A plan crosses process and store boundaries as JSON (``plan.json`` in the run directory, the
job store, ``orchestrate plan --json``); :meth:`Plan.from_json` reads it back into the same value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from orchestrate.core.plan import launch
from orchestrate.core.plan.container import ContainerPlan, NodeInfo, plan_container
from orchestrate.core.plan.memory import ModelFacts
from orchestrate.core.plan.placement import Busy, Choice, check_spare_node, place
from orchestrate.core.plan.ports import master_endpoint
from orchestrate.core.plan.rankenv import common_env, dist_backend, heartbeat_s, node_env, text
from orchestrate.core.plan.ranks import NodeRanks, RankPlan, number_ranks
from orchestrate.core.plan.restart import Policy
from orchestrate.core.plan.settings import SlurmSettings, SSHSettings, slurm_settings
from orchestrate.core.plan.shares import BatchShares
from orchestrate.core.plan.strategy import (
    Decision,
    MemoryPlan,
    decide,
    model_facts,
    placement_need,
    resolved_config,
    slots_for,
)
from orchestrate.core.spec import frameworks

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import (the
    # supervisor and `status` read a stored plan; docs/performance.md)
    from orchestrate.core.spec.inventory import Inventory
    from orchestrate.core.spec.job import JobSpec


@dataclass(frozen=True)
class NodePlan:
    """One node of the job: which GPUs, how many processes, its part of the environment."""

    name: str
    address: str
    node_rank: int
    nproc: int
    first_rank: int
    gpu_indices: tuple[int, ...]
    gpu_models: tuple[str, ...]
    cuda_visible_devices: str | None
    env: dict[str, str]  # node-specific part (on top of Plan.env)
    python: str
    # What orchestrate starts there: the plan's command, "python" replaced by the node's
    # interpreter (launcher: torchrun: the node's torch.distributed.run line running it).
    command: tuple[str, ...]
    partition: str | None = None
    gres_type: str | None = None
    ranks: tuple[RankPlan, ...] = ()
    container: ContainerPlan | None = None  # the node's container (job's ``container:``)

    @property
    def last_rank(self) -> int:
        """The highest global rank on this node."""
        return self.first_rank + self.nproc - 1

    def rank_env(self, rank: RankPlan, common: Mapping[str, str]) -> dict[str, str]:
        """The whole environment of ``rank``: common, then node, then per-rank variables."""
        env = dict(common)
        env.update(self.env)
        env["RANK"] = str(rank.rank)
        env["LOCAL_RANK"] = str(rank.local_rank)
        return env


@dataclass(frozen=True)
class Occupancy:
    """How the hosts are occupied right now, as a backend found them: the input to a re-plan.

    ``busy_gpus``/``busy_slots``: GPUs and CPU slots other running jobs lease, per node;
    ``master_port``: a port found free on the master host, replacing the derived one;
    ``interfaces``: the interface carrying traffic to the master, per node, used where the
    inventory names none; ``excluded``: nodes not to use (a restart avoiding a failed node);
    ``runtimes``: the container runtimes found on a node, where the job names none.
    (Not the records of :mod:`orchestrate.probe.facts`: those describe what a host *is*; this says
    what other jobs hold on it and what the backend found free.)
    """

    busy_gpus: Mapping[str, frozenset[int]] = field(default_factory=dict)
    busy_slots: Mapping[str, int] = field(default_factory=dict)
    master_port: int | None = None
    interfaces: Mapping[str, str] = field(default_factory=dict)
    excluded: frozenset[str] = frozenset()
    runtimes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: GPUs in use outside orchestrate, why, and their free memory; who holds the leased GPUs
    #: and slots (placement's Busy says more).
    in_use: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    free_gb: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    holders: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    slot_holders: Mapping[str, str] = field(default_factory=dict)
    #: GPUs that failed their health check, per node: index -> why (never placed on).
    sick: Mapping[str, Mapping[int, str]] = field(default_factory=dict)

    def busy(self) -> Busy:
        """What placement must avoid."""
        return Busy(self.busy_gpus, self.busy_slots, self.excluded, self.in_use, self.free_gb,
                    self.holders, self.slot_holders, self.sick)


@dataclass(frozen=True)
class Plan:
    """Everything needed to launch the job; the backends and templates add nothing to it."""

    job_id: str
    job_name: str
    backend: str
    dist_backend: str
    world_size: int
    master_addr: str
    master_port: int
    port_fixed: bool  # given by the job (else derived from the job id, and free-checked)
    nodes: tuple[NodePlan, ...]
    env: dict[str, str]  # common to every rank
    command: tuple[str, ...]
    workdir: str
    run_dir: str
    timeout_s: float
    slurm: SlurmSettings
    ssh: SSHSettings
    restart: Policy
    secret_env: tuple[str, ...] = ()
    train_config: dict[str, Any] | None = None
    memory: MemoryPlan | None = None  # the layout and each rank's estimate (train jobs)
    batch: BatchShares | None = None  # the global batch's split (train.global_batch_size)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    time_limit: str | None = None
    master_addr_fixed: bool = False  # MASTER_ADDR set by the job's env (else the first node)
    stall_s: float = 120.0  # distributed.stall_s: 0 = no stall watch
    busy_s: float = 1800.0  # distributed.busy_s, never below stall_s
    on_stall: str = "report"  # distributed.on_stall: report | kill
    sidecar: bool = True  # distributed.sidecar
    launcher: str = "ranks"  # ranks | per_node | torchrun (orchestrate.core.plan.launch)
    on_wrong_world: str = "kill"  # distributed.on_wrong_world: kill | report

    @property
    def per_node(self) -> bool:
        """Whether orchestrate starts one process per node (whose workers are the ranks), not
        one per rank."""
        return self.launcher != launch.RANKS

    def processes(self, node: NodePlan) -> int:
        """How many processes orchestrate itself starts on ``node``."""
        return 1 if self.per_node else node.nproc
    log_cap_bytes: int | None = None  # logs.max_mb_per_rank, in bytes: None = no cap

    @property
    def ranks(self) -> tuple[RankPlan, ...]:
        """Every rank, in rank order."""
        return tuple(r for node in self.nodes for r in node.ranks)

    @property
    def heartbeat_s(self) -> float:
        """The ranks' heartbeat interval (``ORCHESTRATE_HEARTBEAT_S``), from the stall bound."""
        return heartbeat_s(self.stall_s)

    @property
    def uniform(self) -> bool:
        """Whether every node runs the same number of processes."""
        return len({n.nproc for n in self.nodes}) == 1

    def node(self, name: str) -> NodePlan | None:
        """The plan node called ``name``."""
        return next((n for n in self.nodes if n.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """The machine-readable plan (``orchestrate plan --json``, ``plan.json``)."""
        return {
            "job_id": self.job_id,
            "job_name": self.job_name,
            "backend": self.backend,
            "dist_backend": self.dist_backend,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "port_fixed": self.port_fixed,
            "master_addr_fixed": self.master_addr_fixed,
            "nodes": [
                {
                    "name": n.name,
                    "address": n.address,
                    "node_rank": n.node_rank,
                    "nproc": n.nproc,
                    "first_rank": n.first_rank,
                    "gpu_indices": list(n.gpu_indices),
                    "cuda_visible_devices": n.cuda_visible_devices,
                    "gpu_models": list(n.gpu_models),
                    "env": n.env,
                    "python": n.python,
                    "command": list(n.command),
                    "partition": n.partition,
                    "gres_type": n.gres_type,
                    **({"container": n.container.to_json()} if n.container else {}),
                }
                for n in self.nodes
            ],
            "ranks": [asdict(r) for r in self.ranks],
            "env": self.env,
            "command": list(self.command),
            "workdir": self.workdir,
            "run_dir": self.run_dir,
            "timeout_s": self.timeout_s,
            "secret_env": list(self.secret_env),
            "train_config": self.train_config,
            "memory": None if self.memory is None else self.memory.to_json(),
            "batch": None if self.batch is None else self.batch.to_json(),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "time_limit": self.time_limit,
            "slurm": {**asdict(self.slurm), "extra_args": list(self.slurm.extra_args)},
            "ssh": asdict(self.ssh),
            "restart": self.restart.to_json(),
            "stall_s": self.stall_s,
            "busy_s": self.busy_s,
            "on_stall": self.on_stall,
            "sidecar": self.sidecar,
            "launcher": self.launcher,
            "on_wrong_world": self.on_wrong_world,
            "log_cap_bytes": self.log_cap_bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """The plan :meth:`to_json` wrote (a stored plan, ``plan.json``), as a value again."""
        ranks = [RankPlan(**r) for r in data["ranks"]]
        nodes = tuple(
            NodePlan(
                name=n["name"],
                address=n["address"],
                node_rank=int(n["node_rank"]),
                nproc=int(n["nproc"]),
                first_rank=int(n["first_rank"]),
                gpu_indices=tuple(n["gpu_indices"]),
                gpu_models=tuple(n["gpu_models"]),
                cuda_visible_devices=n["cuda_visible_devices"],
                env=dict(n["env"]),
                python=n["python"],
                command=tuple(n["command"]),
                partition=n.get("partition"),
                gres_type=n.get("gres_type"),
                ranks=tuple(r for r in ranks if r.node_rank == n["node_rank"]),
                container=ContainerPlan.from_json(n["container"]) if n.get("container") else None,
            )
            for n in data["nodes"]
        )
        slurm = dict(data["slurm"])
        slurm["extra_args"] = tuple(slurm["extra_args"])
        memory, shares = data.get("memory"), data.get("batch")
        return cls(
            job_id=data["job_id"],
            job_name=data["job_name"],
            backend=data["backend"],
            dist_backend=data["dist_backend"],
            world_size=int(data["world_size"]),
            master_addr=data["master_addr"],
            master_port=int(data["master_port"]),
            port_fixed=bool(data["port_fixed"]),
            master_addr_fixed=bool(data.get("master_addr_fixed", False)),
            nodes=nodes,
            env=dict(data["env"]),
            command=tuple(data["command"]),
            workdir=data["workdir"],
            run_dir=data["run_dir"],
            timeout_s=float(data["timeout_s"]),
            slurm=SlurmSettings(**slurm),
            ssh=SSHSettings(**data["ssh"]),
            restart=Policy.from_json(data["restart"]),
            secret_env=tuple(data.get("secret_env", ())),
            train_config=data.get("train_config"),
            # A plan stored before layouts were planned has no "layout": no memory plan.
            memory=MemoryPlan.from_json(memory) if memory and "layout" in memory else None,
            batch=None if not shares else BatchShares.from_json(shares),
            warnings=tuple(data.get("warnings", ())),
            notes=tuple(data.get("notes", ())),
            time_limit=data.get("time_limit"),
            stall_s=float(data.get("stall_s", 120.0)),
            busy_s=float(data.get("busy_s", max(1800.0, float(data.get("stall_s", 120.0))))),
            on_stall=str(data.get("on_stall", "report")),
            sidecar=bool(data.get("sidecar", True)),
            launcher=str(data.get("launcher", launch.RANKS)),
            on_wrong_world=str(data.get("on_wrong_world", "kill")),
            log_cap_bytes=data.get("log_cap_bytes"),
        )


def checkpoint_dir(plan: Plan) -> str | None:
    """Where the built-in trainer keeps checkpoints for ``plan`` (None for a command job)."""
    if plan.train_config is None:
        return None
    given = plan.train_config.get("checkpoint_dir")
    if not given:
        return f"{plan.run_dir}/checkpoints"
    return given if str(given).startswith("/") else f"{plan.run_dir}/{given}"


def make_plan(
    job: JobSpec,
    inventory: Inventory,
    *,
    job_id: str,
    run_dir: str,
    workdir: str,
    source: str = "job",
    python: str = "python3",
    param_count: float | None = None,
    occupancy: Occupancy | None = None,
    debug: bool = False,
    model: ModelFacts | None = None,
) -> Plan:
    """Turn a job and an inventory into a plan, or raise :class:`UserError` saying why not.

    ``python`` is the interpreter for nodes whose inventory names none; ``model`` what ``load``
    learned of the model (its size, traced peaks), or ``param_count`` its size alone (else
    ``train.model_params``); ``occupancy`` what a backend found on the hosts (see
    :class:`Occupancy`).
    """
    launch.check(job, source)
    occupancy = occupancy or Occupancy()
    warnings: list[str] = []
    model = model_facts(job, model, param_count, source)
    memory = placement_need(job, model)
    placement = place(job, inventory, memory, occupancy.busy(), source)
    choices = placement.choices
    if job.restart.exclude_failed_node and not occupancy.excluded:
        # Asked before the first attempt only: once a node is excluded, the placement above
        # (without it) is the whole question; a restart with no node left cannot start, saying so.
        check_spare_node(job, inventory, memory, occupancy.busy(), source)
    backend = dist_backend(job, placement.any_gpu, source, warnings)
    notes = list(placement.notes)
    frameworks.check(job.framework, job.backend, job.name,
                     [(c.node.name, c.nproc) for c in choices], source, warnings, notes)
    numbered = number_ranks(choices)
    decision = _decide(job, model, numbered, placement.models, source, warnings, notes)
    master_addr, port, addr_fixed, port_fixed = master_endpoint(
        job, choices[0].node.address, job_id, occupancy.master_port)
    world_size = sum(c.nproc for c in choices)
    common = common_env(job, job_id=job_id, run_dir=run_dir, backend=backend,
                        any_gpu=placement.any_gpu, world_size=world_size,
                        master_addr=master_addr, master_port=port, debug=debug)
    command = _command(job, run_dir)
    nodes = _node_plans(job, numbered, common, backend, occupancy.interfaces, python,
                        (command, master_addr, port, job_id))
    nodes = _containers(job, choices, nodes, common, occupancy, notes, source=source,
                        job_id=job_id, run_dir=run_dir, workdir=workdir)
    return Plan(
        job_id=job_id,
        job_name=job.name,
        backend=job.backend,
        dist_backend=backend,
        world_size=world_size,
        master_addr=master_addr,
        master_port=port,
        port_fixed=port_fixed, master_addr_fixed=addr_fixed,
        nodes=nodes,
        env=common,
        command=command,
        workdir=workdir,
        run_dir=run_dir,
        timeout_s=job.distributed.timeout_s,
        slurm=slurm_settings(job, [c.node.name for c in choices]),
        ssh=SSHSettings(fanout=job.ssh.fanout, connect_timeout_s=job.ssh.connect_timeout_s),
        restart=_policy(job),
        secret_env=tuple(job.secret_env),
        train_config=_train_config(job, decision),
        memory=None if decision is None else decision.memory,
        batch=None if decision is None else decision.shares,
        warnings=tuple(warnings),
        notes=tuple(notes),
        time_limit=job.resources.time,
        stall_s=job.distributed.stall_s,
        busy_s=max(job.distributed.busy_s, job.distributed.stall_s),
        on_stall=job.distributed.on_stall,
        sidecar=job.distributed.sidecar,
        launcher=job.launcher, on_wrong_world=job.distributed.on_wrong_world,
        log_cap_bytes=job.logs.cap_bytes,
    )


def _node_plans(job: JobSpec, numbered_nodes: tuple[NodeRanks, ...], common: dict[str, str],
                backend: str, interfaces: Mapping[str, str], python: str,
                start: tuple[tuple[str, ...], str, int, str]) -> tuple[NodePlan, ...]:
    """Every node's part of the plan, in node-rank order; ``start`` is the job's command, the
    master's address and port and the job id (a torchrun node's command holds them). The job's
    ``env`` wins over anything the planner set: a variable of a node's own environment is
    replaced there, any other goes into ``common`` (updated in place: it is the plan's common
    environment being built)."""
    nodes: list[NodePlan] = []
    for numbered in numbered_nodes:
        choice = numbered.choice
        env = node_env(job, choice, numbered.node_rank, len(numbered_nodes) > 1, backend,
                       interfaces.get(choice.node.name))
        env.update(launch.node_env(job.launcher, nnodes=len(numbered_nodes),
                                   node_rank=numbered.node_rank, nproc=choice.nproc,
                                   first_rank=numbered.first_rank, stop_signal=job.slurm.signal,
                                   shutdown_s=job.slurm.signal_seconds_before))
        # The job's env overrides any of it (the master's address and port included): the plan,
        # and so the tables, the JSON and the scripts, show what the ranks will really use.
        for key, value in job.env.items():
            (env if key in env else common)[key] = text(value)
        node_python = choice.node.python or python
        nodes.append(NodePlan(
            name=choice.node.name,
            address=choice.node.address,
            node_rank=numbered.node_rank,
            nproc=choice.nproc,
            first_rank=numbered.first_rank,
            gpu_indices=tuple(g.index for g in choice.gpus),
            gpu_models=tuple(g.model for g in choice.gpus),
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            env=env,
            python=node_python,
            # In a container "python" is the image's interpreter (container.python).
            command=launch.node_command(job.launcher, start,
                                        job.container.python if job.container else node_python,
                                        numbered.node_rank, choice.nproc, len(numbered_nodes)),
            partition=job.slurm.partition or choice.node.partition,
            gres_type=job.slurm.gres_type or choice.node.gres_type,
            ranks=numbered.ranks,
        ))
    return tuple(nodes)


def _containers(job: JobSpec, choices: tuple[Choice, ...], nodes: tuple[NodePlan, ...],
                common: Mapping[str, str], occupancy: Occupancy, notes: list[str], *,
                source: str, **where: str) -> tuple[NodePlan, ...]:
    """Each node's container (:mod:`orchestrate.core.plan.container`)."""
    if job.container is None:
        return nodes
    inventory_nodes = {c.node.name: c.node for c in choices}
    return tuple(replace(node, container=plan_container(job, NodeInfo(
                             inventory_nodes[node.name], node.nproc, node.gpu_indices,
                             (*common, *node.env), occupancy.runtimes.get(node.name)),
                             source=source, notes=notes, **where))
                 for node in nodes)


def _decide(job: JobSpec, model: ModelFacts | None, numbered: tuple[NodeRanks, ...],
            models: list[str], source: str, warnings: list[str], notes: list[str]
            ) -> Decision | None:
    """The layout and the batch shares of a train job (:mod:`~orchestrate.core.plan.strategy`);
    mixed GPU models are worth a warning unless the shares follow their speeds."""
    decision = None if job.train is None else decide(job.train, model, slots_for(numbered),
                                                     source)
    if decision is not None:
        warnings.extend(decision.warnings)
        notes.extend(decision.notes)
    if len(models) > 1 and (decision is None or decision.shares is None
                            or not decision.shares.balanced):
        warnings.append(f"GPU models are mixed across ranks ({', '.join(models)}): "
                        "every step waits for the slowest GPU")
    return decision


def _train_config(job: JobSpec, decision: Decision | None) -> dict[str, Any] | None:
    """train.json: the job's ``train:`` section with what the planner settled written in."""
    if job.train is None or decision is None:
        return None
    return resolved_config(job.train.model_dump(mode="json"), decision)


def _policy(job: JobSpec) -> Policy:
    restart = job.restart
    return Policy(max=restart.max, on=tuple(restart.on), backoff_s=tuple(restart.backoff_s),
                  exclude_failed_node=restart.exclude_failed_node)




def _command(job: JobSpec, run_dir: str) -> tuple[str, ...]:
    if job.train is not None:
        return ("python", "-m", "orchestrate.train", "--config", f"{run_dir}/train.json")
    assert job.command is not None  # the job model guarantees one of the two
    return tuple(job.command)
