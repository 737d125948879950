"""The planner: job + inventory in, a launch plan out. Pure: no files, sockets, clock or dice.

It picks nodes and GPUs, numbers every rank, chooses the master address and port, and computes
the environment of every process. What cannot work is refused here, with the reason, before
anything is queued. Everything the backends and templates need is in :class:`Plan`; templates
only lay it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrate import frameworks, hostlist
from orchestrate.errors import UserError
from orchestrate.inventory import Gpu, Inventory, Node
from orchestrate.job import JobSpec
from orchestrate.memory import GB, MemoryEstimate, estimate, remedies
from orchestrate.ports import derive_port

#: The "model" the planner tries under ``allow_mixed_gpus``: any GPU, of any model.
ANY_GPU = "*"


@dataclass(frozen=True)
class RankPlan:
    """One process."""

    rank: int
    local_rank: int
    node: str
    node_rank: int
    gpu_index: int | None  # CUDA index (PCI bus order) of the GPU it drives, or None on CPU
    gpu_model: str | None


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
    command: tuple[str, ...]  # the plan's command, "python" replaced by the node's interpreter
    partition: str | None = None
    gres_type: str | None = None
    ranks: tuple[RankPlan, ...] = ()

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
    secret_env: tuple[str, ...] = ()
    train_config: dict[str, Any] | None = None
    memory: MemoryEstimate | None = None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    time_limit: str | None = None
    slurm: dict[str, Any] = field(default_factory=dict)
    ssh: dict[str, Any] = field(default_factory=dict)
    master_addr_fixed: bool = False  # MASTER_ADDR set by the job's env (else the first node)

    @property
    def ranks(self) -> tuple[RankPlan, ...]:
        """Every rank, in rank order."""
        return tuple(r for node in self.nodes for r in node.ranks)

    @property
    def uniform(self) -> bool:
        """Whether every node runs the same number of processes."""
        return len({n.nproc for n in self.nodes}) == 1

    def to_json(self) -> dict[str, Any]:
        """The machine-readable plan (``orchestrate plan --json``)."""
        return {
            "job_id": self.job_id,
            "job_name": self.job_name,
            "backend": self.backend,
            "dist_backend": self.dist_backend,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "port_fixed": self.port_fixed,
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
                }
                for n in self.nodes
            ],
            "ranks": [
                {
                    "rank": r.rank,
                    "local_rank": r.local_rank,
                    "node": r.node,
                    "node_rank": r.node_rank,
                    "gpu_index": r.gpu_index,
                    "gpu_model": r.gpu_model,
                }
                for r in self.ranks
            ],
            "env": self.env,
            "command": list(self.command),
            "workdir": self.workdir,
            "run_dir": self.run_dir,
            "timeout_s": self.timeout_s,
            "secret_env": list(self.secret_env),
            "memory": None if self.memory is None else asdict(self.memory),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "time_limit": self.time_limit,
            "slurm": self.slurm,
            "ssh": self.ssh,
        }


@dataclass(frozen=True)
class _Choice:
    node: Node
    gpus: tuple[Gpu, ...]  # empty on CPU-only nodes
    nproc: int


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
    busy_gpus: Mapping[str, frozenset[int]] | None = None,
    master_port: int | None = None,
    interfaces: Mapping[str, str] | None = None,
) -> Plan:
    """Turn a job and an inventory into a plan, or raise :class:`UserError` saying why not.

    ``python`` is the interpreter for nodes whose inventory names none; ``param_count`` the
    model size when the caller counted it (else ``train.model_params``); ``busy_gpus`` the GPUs
    other running jobs hold per node (leases), which are not picked; ``master_port`` a port the
    backend found free, replacing the derived one; ``interfaces`` the network interface per node
    that a backend found carrying traffic to the master (SSH preflight), used for
    GLOO/NCCL_SOCKET_IFNAME where the inventory names none.
    """
    res = job.resources
    warnings: list[str] = []
    notes: list[str] = []
    memory = _memory(job, param_count)
    nodes = _candidate_nodes(job, inventory, source)
    choices = _choose(job, inventory, nodes, memory, busy_gpus or {}, source, notes)

    any_gpu = any(c.gpus for c in choices)
    dist_backend = _dist_backend(job, any_gpu, source, warnings)
    frameworks.check(job.framework, job.backend, job.name,
                     [(c.node.name, c.nproc) for c in choices], source, warnings, notes)
    if len({g.model for c in choices for g in c.gpus}) > 1:
        warnings.append(
            "GPU models are mixed across ranks ("
            + ", ".join(sorted({g.model for c in choices for g in c.gpus}))
            + "): every step waits for the slowest GPU"
        )

    port_fixed = isinstance(job.distributed.master_port, int)
    if master_port is not None:
        port = master_port
    elif isinstance(job.distributed.master_port, int):
        port = job.distributed.master_port
    else:
        port = derive_port(job_id)

    master_addr = choices[0].node.address
    # The job's env overrides any of it, the master's address and port included; the plan
    # (and so the table, the JSON and the sbatch) then shows what the ranks will really use.
    addr_fixed = "MASTER_ADDR" in job.env
    if addr_fixed:
        master_addr = _text(job.env["MASTER_ADDR"])
    if "MASTER_PORT" in job.env:
        port = _env_port(job.env["MASTER_PORT"], source)
        port_fixed = True
    world_size = sum(c.nproc for c in choices)
    common: dict[str, str] = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "ORCHESTRATE_JOB_ID": job_id,
        "ORCHESTRATE_RUN_DIR": run_dir,
        "ORCHESTRATE_DIST_BACKEND": dist_backend,
        "ORCHESTRATE_TIMEOUT_S": _number(job.distributed.timeout_s),
        "PYTHONUNBUFFERED": "1",
    }
    common.update(frameworks.common_env(job.backend, job_id, any_gpu))
    if any_gpu:
        common["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if dist_backend == "nccl":
        # A rank that dies must not leave the others blocked inside a collective until the
        # process-group timeout: async error handling tears the communicator down.
        common["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"

    command = _command(job, run_dir)
    node_plans: list[NodePlan] = []
    first = 0
    multi_node = len(choices) > 1
    for node_rank, choice in enumerate(choices):
        found = (interfaces or {}).get(choice.node.name)
        node_env = _node_env(job, choice, node_rank, multi_node, dist_backend, found)
        for key, value in job.env.items():
            (node_env if key in node_env else common)[key] = _text(value)
        ranks = tuple(
            RankPlan(
                rank=first + local,
                local_rank=local,
                node=choice.node.name,
                node_rank=node_rank,
                gpu_index=choice.gpus[local].index if choice.gpus else None,
                gpu_model=choice.gpus[local].model if choice.gpus else None,
            )
            for local in range(choice.nproc)
        )
        node_plans.append(
            NodePlan(
                name=choice.node.name,
                address=choice.node.address,
                node_rank=node_rank,
                nproc=choice.nproc,
                first_rank=first,
                gpu_indices=tuple(g.index for g in choice.gpus),
                gpu_models=tuple(g.model for g in choice.gpus),
                cuda_visible_devices=node_env.get("CUDA_VISIBLE_DEVICES"),
                env=node_env,
                python=choice.node.python or python,
                command=_node_command(command, choice.node.python or python),
                partition=job.slurm.partition or choice.node.partition,
                gres_type=job.slurm.gres_type or choice.node.gres_type,
                ranks=ranks,
            )
        )
        first += choice.nproc

    train_config = None if job.train is None else job.train.model_dump(mode="json")
    return Plan(
        job_id=job_id,
        job_name=job.name,
        backend=job.backend,
        dist_backend=dist_backend,
        world_size=world_size,
        master_addr=master_addr,
        master_port=port,
        port_fixed=port_fixed,
        master_addr_fixed=addr_fixed,
        nodes=tuple(node_plans),
        env=common,
        command=command,
        workdir=workdir,
        run_dir=run_dir,
        timeout_s=job.distributed.timeout_s,
        secret_env=tuple(job.secret_env),
        train_config=train_config,
        memory=memory,
        warnings=tuple(warnings),
        notes=tuple(notes),
        time_limit=res.time,
        slurm=job.slurm.model_dump(mode="json")
        | {
            "cpus_per_task": res.cpus_per_task,
            "mem_gb": res.mem_gb,
            "mem": None if res.mem_gb is None else _slurm_memory(res.mem_gb),
            # Nodes the job names are the nodes Slurm must give it.
            "nodelist": None
            if res.node_names is None
            else hostlist.compress([n.name for n in nodes]),
        },
        ssh=job.ssh.model_dump(mode="json"),
    )


def _slurm_memory(gb: float) -> str:
    """``--mem`` as sbatch takes it: a whole number and a unit (``900G``; it refuses ``900.0G``)."""
    return f"{int(gb)}G" if float(gb).is_integer() else f"{max(1, round(gb * 1024))}M"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _text(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _command(job: JobSpec, run_dir: str) -> tuple[str, ...]:
    if job.train is not None:
        return ("python", "-m", "orchestrate.train", "--config", f"{run_dir}/train.json")
    assert job.command is not None  # the job model guarantees one of the two
    return tuple(job.command)


def _node_command(command: tuple[str, ...], python: str) -> tuple[str, ...]:
    # "python train.py" in a job means the node's interpreter (inventory 'python'), which is
    # what people mean on servers whose PATH has no training environment.
    if command and command[0] in ("python", "python3"):
        return (python, *command[1:])
    return command


def _memory(job: JobSpec, param_count: float | None) -> MemoryEstimate | None:
    if job.train is None:
        return None
    params = param_count if param_count is not None else job.train.model_params
    if params is None:
        return None
    return estimate(job.train, params)


def _candidate_nodes(job: JobSpec, inventory: Inventory, source: str) -> list[Node]:
    given = job.resources.node_names
    if given is None:
        return list(inventory.nodes)
    try:  # node_names may use hostlists, like the inventory: [gpu[01-04], gpu09]
        names = [name for item in given for name in hostlist.expand(item)]
    except ValueError as exc:
        raise UserError.single(
            str(exc), source=source, field="resources.node_names", got=given
        ) from None
    by_name = {node.name: node for node in inventory.nodes}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise UserError.single(
            f"node {', '.join(repr(u) for u in unknown[:12])} not in inventory '{inventory.name}'",
            source=source,
            field="resources.node_names",
            hint="nodes there: " + _short_list([n.name for n in inventory.nodes]),
        )
    if len(set(names)) != len(names):
        raise UserError.single(
            "a node is named twice", source=source, field="resources.node_names", got=given
        )
    return [by_name[name] for name in names]


def _env_port(value: str | int | float | bool, source: str) -> int:
    """MASTER_PORT from the job's env, which must be a port number like distributed's."""
    text = _text(value)
    if not text.isdigit() or not 1024 <= int(text) <= 65535:
        raise UserError.single(
            "MASTER_PORT must be a port between 1024 and 65535",
            source=source,
            field="env.MASTER_PORT",
            got=text,
            hint="or set distributed.master_port, or leave both out for a derived port",
        )
    return int(text)


def _short_list(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _choose(
    job: JobSpec,
    inventory: Inventory,
    nodes: list[Node],
    memory: MemoryEstimate | None,
    busy: Mapping[str, frozenset[int]],
    source: str,
    notes: list[str],
) -> list[_Choice]:
    res = job.resources
    if job.backend == "local" and res.nodes > 1:
        raise UserError.single(
            "the local backend runs on this machine only",
            source=source,
            field="resources.nodes",
            got=res.nodes,
            hint="use backend: ssh or slurm for several nodes",
        )
    wanted_model = res.gpu_model
    if wanted_model is not None:
        counts = inventory.model_counts()
        if not any(m.lower() == wanted_model.lower() for m in counts):
            there = ", ".join(f"{m} ({n})" for m, n in counts.items()) or "none (CPU-only)"
            raise UserError.single(
                f"gpu_model '{wanted_model}' not in inventory '{inventory.name}'; "
                f"models there: {there}",
                source=source,
                field="resources.gpu_model",
                hint="set resources.gpu_model to one of them, or leave it out",
            )
    models: list[str | None]
    if wanted_model is not None:
        models = [wanted_model]
    elif res.allow_mixed_gpus:
        # Any GPU model, but never GPU and CPU-only nodes in one job (nccl needs a GPU per
        # rank); CPU-only nodes are the fallback kind, as below.
        models = [ANY_GPU] + ([None] if any(not n.is_gpu for n in nodes) else [])
    else:
        # One model across all ranks: try each model in inventory order (CPU-only nodes are
        # their own kind), and take the first that yields enough nodes.
        models = list(dict.fromkeys(g.model for n in nodes for g in n.gpus))
        if any(not n.is_gpu for n in nodes):
            models.append(None)
        models = models or [None]
    reasons: dict[str, list[tuple[str, str]]] = {}
    for model in models:
        picked: list[_Choice] = []
        why: list[tuple[str, str]] = []
        for node in nodes:
            choice, reason = _fit(job, node, model, memory, busy.get(node.name, frozenset()))
            if choice is None:
                why.append((node.name, reason))
            else:
                picked.append(choice)
            if len(picked) == res.nodes:
                break
        if len(picked) == res.nodes:
            if len(models) > 1 and model is not None and model != ANY_GPU:
                notes.append(
                    f"picked GPU model {model}; set resources.gpu_model to choose another"
                )
            return picked
        reasons[model or "cpu"] = why
    raise _refusal(job, nodes, memory, reasons, source)


def _fit(
    job: JobSpec,
    node: Node,
    model: str | None,
    memory: MemoryEstimate | None,
    busy: frozenset[int],
) -> tuple[_Choice | None, str]:
    res = job.resources
    if not node.is_gpu:
        if res.gpu_model is not None or res.min_gpu_memory_gb is not None or model is not None:
            return None, "CPU-only"
        want = node.capacity if res.gpus_per_node == "all" else res.gpus_per_node
        if want > node.capacity:
            return None, f"{node.capacity} slots, {want} requested"
        return _Choice(node, (), want), ""
    if model is None:
        return None, "has GPUs (the job runs on CPU-only nodes)"
    gpus = [g for g in node.gpus if model == ANY_GPU or g.model.lower() == model.lower()]
    if not gpus:
        return None, f"no {model} GPU"
    if res.min_gpu_memory_gb is not None:
        gpus = [g for g in gpus if g.memory_gb >= res.min_gpu_memory_gb]
        if not gpus:
            return None, f"no GPU with at least {res.min_gpu_memory_gb:g} GB"
    if memory is not None:
        fits = [g for g in gpus if g.memory_gb * GB >= memory.total]
        if not fits:
            small = max(gpus, key=lambda g: g.memory_gb)
            return None, f"model does not fit ({small.model} has {small.memory_gb:g} GB)"
        gpus = fits
    free = [g for g in gpus if g.index not in busy]
    want = len(free) if res.gpus_per_node == "all" else res.gpus_per_node
    if want == 0 or len(free) < want:
        held = len(gpus) - len(free)
        extra = f" ({held} held by other jobs)" if held else ""
        return None, f"{len(free)} usable GPU(s){extra}, {want or 1} requested"
    return _Choice(node, tuple(free[:want]), want), ""


def _refusal(
    job: JobSpec,
    nodes: list[Node],
    memory: MemoryEstimate | None,
    reasons: dict[str, list[tuple[str, str]]],
    source: str,
) -> UserError:
    res = job.resources
    if memory is not None and job.train is not None:
        gpus = [g for n in nodes for g in n.gpus if _eligible(job, g)]
        if gpus and all(g.memory_gb * GB < memory.total for g in gpus):
            biggest = max(gpus, key=lambda g: g.memory_gb)
            return UserError.single(
                f"{memory.describe()}; {biggest.model} has {biggest.memory_gb:g} GB, "
                "the most of any GPU this job may use",
                source=source,
                field="train",
                hint="try " + remedies(job.train),
            )
    # Show the attempt (GPU model) that came closest; on a tie, the one with more GPUs.
    capacity = {
        kind: sum(
            1 for n in nodes for g in n.gpus if kind in (ANY_GPU, "cpu") or g.model == kind
        )
        for kind in reasons
    }
    best_kind = max(reasons, key=lambda k: (len(nodes) - len(reasons[k]), capacity[k]), default="")
    best = reasons.get(best_kind, [])
    matched = len(nodes) - len(best)
    detail = "; ".join(_group_reasons(best))
    unit = "slots" if best_kind == "cpu" else "GPUs"
    each = f"all {unit}" if res.gpus_per_node == "all" else f"{res.gpus_per_node} {unit}"
    plural = "node" if res.nodes == 1 else "nodes"
    return UserError.single(
        f"{res.nodes} {plural} requested ({each} each), {matched} match"
        + (f": {detail}" if detail else ""),
        source=source,
        field="resources",
        hint="lower resources.nodes or gpus_per_node, relax gpu_model/min_gpu_memory_gb, "
        "or set allow_mixed_gpus",
    )


def _eligible(job: JobSpec, gpu: Gpu) -> bool:
    """Whether the job's model and memory-floor filters let it use ``gpu``."""
    res = job.resources
    if res.gpu_model is not None and gpu.model.lower() != res.gpu_model.lower():
        return False
    return res.min_gpu_memory_gb is None or gpu.memory_gb >= res.min_gpu_memory_gb


def _group_reasons(reasons: list[tuple[str, str]], limit: int = 6) -> list[str]:
    """Nodes refused for the same reason share one entry: ``gpu[01-16]: no A100 GPU``."""
    by_reason: dict[str, list[str]] = {}
    for name, why in reasons:
        by_reason.setdefault(why, []).append(name)
    lines = [f"{hostlist.compress(names)}: {why}" for why, names in by_reason.items()]
    if len(lines) > limit:
        return [*lines[:limit], f"... ({len(lines) - limit} more reasons)"]
    return lines


def _dist_backend(job: JobSpec, any_gpu: bool, source: str, warnings: list[str]) -> str:
    asked = job.distributed.backend
    if asked == "auto":
        return "nccl" if any_gpu else "gloo"
    if asked == "nccl" and not any_gpu:
        raise UserError.single(
            "nccl needs GPUs, and the chosen nodes are CPU-only",
            source=source,
            field="distributed.backend",
            got="nccl",
            hint="use 'auto' or 'gloo'",
        )
    if asked == "gloo" and any_gpu:
        warnings.append(
            "gloo on GPUs is several times slower than nccl (5-20x measured); "
            "use distributed.backend: auto unless you know why"
        )
    return asked


def _node_env(
    job: JobSpec,
    choice: _Choice,
    node_rank: int,
    multi_node: bool,
    dist_backend: str,
    found_interface: str | None = None,
) -> dict[str, str]:
    node = choice.node
    env: dict[str, str] = {
        "LOCAL_WORLD_SIZE": str(choice.nproc),
        "GROUP_RANK": str(node_rank),
    }
    env.update(frameworks.node_env(job.backend, node_rank, choice.nproc))
    if choice.gpus:
        # Every local rank sees all of the job's GPUs on the node and uses cuda:LOCAL_RANK;
        # isolating one GPU per process would block NCCL peer-to-peer over NVLink.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in choice.gpus)
    threads = job.distributed.omp_num_threads
    if threads is None:
        threads = max(1, node.cpus // choice.nproc) if node.cpus else 1
    env["OMP_NUM_THREADS"] = str(threads)
    net = node.network
    # The inventory's interface wins; else the one a backend discovered on the node at submit.
    interface = net.interface if net is not None and net.interface else found_interface
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
        if dist_backend == "nccl":
            env["NCCL_SOCKET_IFNAME"] = interface
    if dist_backend == "nccl":
        if (net is not None and net.fabric == "ethernet") or (net is None and multi_node):
            env["NCCL_IB_DISABLE"] = "1"
        if net is not None and net.hca:
            env["NCCL_IB_HCA"] = net.hca
        if node.gpu_link == "none":
            env["NCCL_P2P_DISABLE"] = "1"
    return env
