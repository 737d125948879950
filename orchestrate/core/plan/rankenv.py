"""The environment of every rank: the torchrun contract plus what the interconnect asks for.

Pure. Each rank's environment is three layers, later ones winning: the variables common to the
job (:func:`common_env`: WORLD_SIZE, MASTER_ADDR, MASTER_PORT, orchestrate's own), the node's
(:func:`node_env`: LOCAL_WORLD_SIZE, GROUP_RANK, CUDA_VISIBLE_DEVICES, threads, the NCCL and gloo
settings its network and GPU link call for), then RANK and LOCAL_RANK
(:meth:`orchestrate.core.plan.plan.NodePlan.rank_env`). The job's own ``env`` overrides the first
two (the planner applies it), so what the plan shows is what the ranks see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.core.errors import UserError
from orchestrate.core.plan.placement import Choice
from orchestrate.core.spec import frameworks
from orchestrate.core.spec.backendtraits import traits
from orchestrate.core.spec.cpulist import cpu_set

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import (the
    # supervisor and `status` read a stored plan; docs/performance.md)
    from orchestrate.core.spec.job import JobSpec

#: The attempt a rank belongs to (1, then 2 after a restart or a resume), set by the launcher
#: at start time (not in the scripts, which stay the same for every attempt): a ``command:``
#: program that resumes itself reads it.
ATTEMPT_VAR = "ORCHESTRATE_ATTEMPT"

#: Each local rank's CPUs, ``;``-separated: the rank sidecar binds the rank to them (read by
#: :mod:`orchestrate.hostside.cpubind`, which names it too: the core may not import it);
#: ``slurm``: each rank finds its GPU's CPUs itself (Slurm chose the GPUs).
CPU_BIND_VAR = "ORCHESTRATE_CPU_BIND"


def heartbeat_s(stall_s: float) -> float:
    """The sidecar's heartbeat interval for a stall bound: at most 2.5 s (a beat costs 0.1 ms),
    and at least a dozen beats within the bound, so a silent rank is told from a slow beat."""
    if stall_s <= 0:
        return 2.5
    return round(min(2.5, max(0.5, stall_s / 12.0)), 2)


def dist_backend(job: JobSpec, any_gpu: bool, source: str, warnings: list[str]) -> str:
    """nccl on GPUs, gloo on CPUs, unless the job says otherwise (and that can work)."""
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


def common_env(
    job: JobSpec,
    *,
    job_id: str,
    run_dir: str,
    backend: str,
    any_gpu: bool,
    world_size: int,
    master_addr: str,
    master_port: int,
    debug: bool = False,
) -> dict[str, str]:
    """What every rank of the job shares. With nccl, the flight recorder dumps into the run
    directory when a collective times out; ``debug`` (``submit --debug``) adds NCCL's own log
    (per host and process, in the run directory) and torch's collective checks, which cost
    milliseconds per collective (docs/hangs.md)."""
    env: dict[str, str] = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "ORCHESTRATE_JOB_ID": job_id,
        "ORCHESTRATE_RUN_DIR": run_dir,
        "ORCHESTRATE_DIST_BACKEND": backend,
        "ORCHESTRATE_TIMEOUT_S": number(job.distributed.timeout_s),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(frameworks.common_env(job.backend, job_id, any_gpu))
    if job.launcher != "ranks":
        # The rank sidecar reads it: a per_node program's workers get their heartbeats once they
        # join their process group (their rank is the one they join with).
        env["ORCHESTRATE_LAUNCHER"] = job.launcher
    if job.launcher == "per_node":
        # Lightning would take it as "ranks come from RANK", which a node's one process lacks.
        env.pop("TORCHELASTIC_RUN_ID", None)
    if job.distributed.sidecar:
        # The rank sidecar's heartbeat: a few beats within the stall bound (docs/hangs.md).
        env["ORCHESTRATE_HEARTBEAT_S"] = number(heartbeat_s(job.distributed.stall_s))
    else:
        env["ORCHESTRATE_SIDECAR"] = "0"
    if any_gpu:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if backend == "nccl":
        # A rank that dies must not leave the others blocked inside a collective until the
        # process-group timeout: async error handling tears the communicator down.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        # What every rank was doing when a collective timed out, for `orchestrate diagnose`
        # (the flight recorder is on by default since torch 2.6; older names are set too).
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{run_dir}/diag/fr/nccl_rank_"
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = f"{run_dir}/diag/fr/nccl_rank_"
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        if backend == "nccl":
            env["NCCL_DEBUG"] = "INFO"
            env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
            env["NCCL_DEBUG_FILE"] = f"{run_dir}/nccl/%h.%p.log"
    return env


def node_env(
    job: JobSpec,
    choice: Choice,
    node_rank: int,
    multi_node: bool,
    backend: str,
    found_interface: str | None = None,
) -> dict[str, str]:
    """What the ranks of one node share beyond the common part.

    ``found_interface`` is the interface a backend found carrying traffic to the master on that
    node (SSH preflight); the inventory's interface wins over it.
    """
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
    env.update(binding_env(job, choice))
    net = node.network
    interface = net.interface if net is not None and net.interface else found_interface
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface.lstrip("=")
        if backend == "nccl":
            env["NCCL_SOCKET_IFNAME"] = exact(interface)
    if backend == "nccl":
        if (net is not None and net.fabric == "ethernet") or (net is None and multi_node):
            env["NCCL_IB_DISABLE"] = "1"
        if net is not None and net.hca:
            env["NCCL_IB_HCA"] = exact(net.hca)
        if node.gpu_link == "none":
            env["NCCL_P2P_DISABLE"] = "1"
    return env


def binding_env(job: JobSpec, choice: Choice) -> dict[str, str]:
    """Where the node's ranks run: ``ORCHESTRATE_CPU_BIND`` (each rank's GPU's NUMA node, or
    ``slurm`` where the scheduler picks the GPUs and each rank finds its own) and
    ``OMP_NUM_THREADS`` (the CPUs bound per rank, else the node's CPUs over its ranks)."""
    env: dict[str, str] = {}
    binding = None
    if traits(job.backend).scheduler_allocates:
        if choice.gpus:
            env[CPU_BIND_VAR] = "slurm"
    else:
        binding = cpu_binding(choice)
        if binding is not None:
            env[CPU_BIND_VAR] = ";".join(binding)
    threads = job.distributed.omp_num_threads
    if threads is None and binding is not None:
        threads = bound_threads(binding)
    if threads is None:
        cpus = choice.node.cpus
        threads = max(1, cpus // choice.nproc) if cpus else 1
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def cpu_binding(choice: Choice) -> list[str] | None:
    """Each local rank's CPUs (a CPU list), those of its GPU's NUMA node (local rank i drives
    ``cuda:i``, the i-th GPU of the node's choice), or None when a GPU's NUMA node is unknown.
    The launch scripts hand it to the rank sidecar, which binds the rank
    (:mod:`orchestrate.hostside.cpubind`)."""
    if not choice.gpus or len(choice.gpus) != choice.nproc:
        return None
    numas = [choice.node.numa_of(g.index) for g in choice.gpus]
    cpus = [n.cpus for n in numas if n is not None]
    return cpus if len(cpus) == len(numas) else None


def bound_threads(binding: list[str]) -> int:
    """OMP_NUM_THREADS for ranks bound so: the CPUs of a NUMA node shared by its ranks (the
    fewest any rank gets, so no rank's threads outnumber its cores)."""
    ranks: dict[str, int] = {}
    for cpus in binding:
        ranks[cpus] = ranks.get(cpus, 0) + 1
    return max(1, min(len(cpu_set(cpus)) // n for cpus, n in ranks.items()))


def exact(names: str) -> str:
    """NCCL matches NCCL_SOCKET_IFNAME and NCCL_IB_HCA by *prefix*: ``eth1`` also selects
    ``eth10``, ``mlx5_1`` also ``mlx5_10``. A leading ``=`` asks for exactly the names given
    (a leading ``^``, an exclusion list, is the user's own and kept as written)."""
    return names if names.startswith(("=", "^")) else f"={names}"


def number(value: float) -> str:
    """``600`` for 600.0, ``0.5`` for 0.5: numbers as a person writes them in a variable."""
    return str(int(value)) if float(value).is_integer() else str(value)


def text(value: str | int | float | bool) -> str:
    """A job's ``env`` value as the variable's text (booleans as 1/0, as shells expect)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
