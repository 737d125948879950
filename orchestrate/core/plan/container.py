"""Each node's container: which runtime, and the exact command lines that run its ranks. Pure.

A job with a ``container:`` section (:class:`orchestrate.core.spec.container.ContainerSpec`)
runs every rank in the image, with what NCCL needs settled here, per node, so that ``render``
shows every flag (docs/containers.md has the why of each):

- **one container per node** running all of that node's ranks: ranks that share a node share
  its IPC namespace, so CUDA IPC between them works (separate containers per rank break it:
  NCCL #360). podman and docker: the node's first rank to start creates it (a ``sleep`` keeps it
  up), every rank of the node runs in it (``exec``), and it is removed by name when the last
  one is gone, or when the backend stops the job. pyxis creates one per node for the srun step
  and every task joins it; apptainer shares the host's namespaces anyway;
- **host networking** (bridges break the cross-host bootstrap: nccl-tests #14) and **host IPC**
  (``--ipc=host``), or with ``ipc: private`` a ``/dev/shm`` sized from the plan (1 GiB per rank
  on the node unless ``shm_size`` says): Docker's default 64 MB makes NCCL fail or hang at
  init. Never both: podman refuses the pair;
- on InfiniBand/RoCE nodes unlimited locked memory, ``/dev/infiniband`` and ``IPC_LOCK``
  (RDMA registers its buffers);
- the planned GPUs only (CDI devices for podman, ``--gpus`` for docker), with
  CUDA_VISIBLE_DEVICES inside naming the same GPUs in the container's own numbering (0..n-1,
  in PCI bus order as outside); under Slurm, the GPUs the task was given;
- the run directory (scripts, sidecar, logs, checkpoints) and the workdir mounted at their own
  paths, then the job's mounts;
- every variable the plan sets passed in by name (pyxis lets an image's values win over the
  host's otherwise, and enroot's PyTorch hook sets MASTER_PORT in the ephemeral range), the
  job's tag among them, so kill-by-tag and the lease book still see every rank.

The runtime is the job's ``container.runtime``, else what the node has (the inventory's
``containers``, or what a backend found there: :class:`orchestrate.core.plan.plan.Occupancy`),
podman first; unknown, podman (a backend checks it before launch). On Slurm the default is pyxis.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from orchestrate.core.errors import UserError
from orchestrate.core.spec.backendtraits import traits

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import
    from orchestrate.core.spec.container import ContainerSpec, Mount
    from orchestrate.core.spec.inventory import Node
    from orchestrate.core.spec.job import JobSpec

#: Runtimes whose node container orchestrate starts, enters and removes itself.
NODE_CONTAINER = ("podman", "docker")
#: The variable each rank's processes carry inside, so its launcher finds them from the host.
RANK_MARK = "ORCHESTRATE_CONTAINER_RANK"
#: Image paths pyxis or apptainer run, that podman and docker cannot.
_IMAGE_FILES = (".sqsh", ".squashfs", ".sif", ".simg")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")
GiB = 1 << 30


@dataclass(frozen=True)
class ContainerPlan:
    """How one node's ranks run in a container (see the module docstring)."""

    runtime: str
    image: str  # as the runtime reads it (pyxis: ``registry#image``; apptainer: ``docker://``)
    name: str  # the node's container (podman, docker), named per job and node
    #: podman/docker: the command that starts the node's container, up to its GPUs; pyxis:
    #: srun's container options; apptainer: the command a task's shell runs under.
    start: tuple[str, ...]
    #: podman/docker: what follows the GPU options (the keeper: ``--entrypoint=sleep IMAGE
    #: infinity``).
    keeper: tuple[str, ...] = ()
    #: podman/docker: ``exec`` and its options, before the container's name.
    enter: tuple[str, ...] = ()
    #: podman/docker: ``rm -f``, before the container's name (or id).
    remove: tuple[str, ...] = ()
    #: Host paths that must exist on the node (the job's mounts), checked before it starts.
    sources: tuple[str, ...] = ()
    #: Host variables passed in by name (the plan's, the job's ``container.env``).
    env: tuple[str, ...] = ()
    #: Planned GPUs passed in (CUDA indices); under Slurm the task's, known at run time.
    gpus: tuple[int, ...] = ()
    gpus_from_task: bool = False
    #: CUDA_VISIBLE_DEVICES inside (the same GPUs, numbered as the container sees them).
    cuda_visible_devices: str | None = None
    ipc: str = "host"
    shm_size: str | None = None
    memlock: bool = False  # unlimited locked memory and /dev/infiniband (InfiniBand/RoCE)
    python: str = "python3"
    #: Capture the host's IOMMU/ACS settings when the container starts (GPU nodes), for the
    #: doctor, which runs inside.
    host_checks: bool = False
    options: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """A JSON value (in ``plan.json``)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ContainerPlan:
        """The value :meth:`to_json` wrote."""
        def words(key: str) -> tuple[str, ...]:
            return tuple(str(w) for w in data.get(key) or ())

        return cls(
            runtime=str(data["runtime"]), image=str(data["image"]), name=str(data["name"]),
            start=words("start"), keeper=words("keeper"), enter=words("enter"),
            remove=words("remove"), sources=words("sources"), env=words("env"),
            gpus=tuple(int(g) for g in data.get("gpus") or ()),
            gpus_from_task=bool(data.get("gpus_from_task", False)),
            cuda_visible_devices=data.get("cuda_visible_devices"),
            ipc=str(data.get("ipc", "host")), shm_size=data.get("shm_size"),
            memlock=bool(data.get("memlock", False)), python=str(data.get("python", "python3")),
            host_checks=bool(data.get("host_checks", False)), options=words("options"))


def container_name(job_id: str, node: str) -> str:
    """``orchestrate-<job>-<node>``: what podman and docker call the node's container."""
    return _UNSAFE_NAME.sub("_", f"orchestrate-{job_id}-{node}")


def runtime_for(job: JobSpec, node: Node, found: tuple[str, ...] | None, source: str,
                notes: list[str]) -> str:
    """The node's runtime: the job's, else what the node has (podman first), else the
    backend's default; a runtime the backend cannot use, or the node lacks, is refused."""
    spec = job.container
    assert spec is not None
    kind = traits(job.backend)
    allowed = kind.container_runtimes
    known = found if found is not None else node.containers
    if spec.runtime is not None:
        if spec.runtime not in allowed:
            raise UserError.single(
                f"{spec.runtime} does not run on the {job.backend} backend",
                source=source, field="container.runtime", got=spec.runtime,
                hint=_runtime_hint(job.backend, spec.runtime))
        if known is not None and spec.runtime not in known:
            raise UserError.single(
                f"node {node.name} has no {spec.runtime} (it has: "
                f"{', '.join(known) or 'no container runtime'})",
                source=source, field="container.runtime", got=spec.runtime,
                hint="install it there, choose another runtime, or correct the inventory's "
                "containers for the node (inventory probe records them)")
        return spec.runtime
    if kind.container_default is not None:
        return kind.container_default
    if known is None:
        notes.append(f"container runtime on {node.name}: podman assumed (not known; "
                     "submit checks it, `inventory probe` records it)")
        return "podman"
    for runtime in allowed:
        if runtime in known:
            return runtime
    raise UserError.single(
        f"node {node.name} has no container runtime orchestrate can use here "
        f"({' or '.join(allowed)}; it has: {', '.join(known) or 'none'})",
        source=source, field="container.runtime",
        hint="install podman (or docker) there, or correct the inventory's containers")


def _runtime_hint(backend: str, runtime: str) -> str:
    if runtime in ("pyxis", "apptainer"):
        return f"{runtime} runs under Slurm (backend: slurm); on {backend} use podman or docker"
    return ("docker under Slurm starts containers outside the job's allocation (its daemon "
            "does): use pyxis, apptainer or podman")


@dataclass(frozen=True)
class NodeInfo:
    """What the container of one node depends on beyond the job."""

    node: Node
    nproc: int
    gpus: tuple[int, ...]
    env_names: tuple[str, ...]  # every variable the plan sets for this node's ranks
    found: tuple[str, ...] | None  # runtimes a backend found there (None: not looked)


def plan_container(job: JobSpec, info: NodeInfo, *, job_id: str, run_dir: str, workdir: str,
                   source: str, notes: list[str]) -> ContainerPlan | None:
    """The container of one node, or None when the job has none."""
    spec = job.container
    if spec is None:
        return None
    runtime = runtime_for(job, info.node, info.found, source, notes)
    image = _image(spec, runtime, source)
    mounts = _mounts(spec, run_dir, workdir, source)
    env = _env_names(job, info.env_names, runtime)
    if runtime in NODE_CONTAINER:
        return _node_container(job, spec, info, runtime, image, mounts, env, job_id, workdir)
    if spec.ipc != "host":
        raise UserError.single(
            f"{runtime} runs in the host's IPC namespace: ipc: private is for podman and docker",
            source=source, field="container.ipc", got=spec.ipc,
            hint="drop it (the host's /dev/shm is what NCCL wants)")
    base = ContainerPlan(
        runtime=runtime, image=image, name=container_name(job_id, info.node.name), start=(),
        sources=tuple(m.source for m in spec.parsed_mounts()), env=env, python=spec.python,
        options=tuple(spec.options), host_checks=bool(info.gpus))
    if runtime == "pyxis":
        return replace(base, start=_pyxis_flags(spec, image, mounts, env, workdir))
    return replace(base, start=(
        "apptainer", "exec", *(("--nv",) if info.gpus else ()),
        "--bind=" + ",".join(_mount_text(m) for m in mounts), f"--pwd={workdir}",
        *spec.options, image))


def _node_container(job: JobSpec, spec: ContainerSpec, info: NodeInfo, runtime: str,
                    image: str, mounts: Sequence[Mount], env: tuple[str, ...], job_id: str,
                    workdir: str) -> ContainerPlan:
    """podman or docker: the node's container, started by its first rank, entered by each."""
    node = info.node
    name = container_name(job_id, node.name)
    fabric = node.network.fabric if node.network is not None else None
    memlock = fabric in ("infiniband", "roce")
    shm = None
    if spec.ipc == "private":
        shm = spec.shm_size or f"{max(1, info.nproc)}g"  # 1 GiB per rank of the node
    start = [runtime, "run", "--detach", "--rm", f"--name={name}",
             f"--label=orchestrate.job={job_id}", f"--label=orchestrate.node={node.name}",
             "--network=host", "--ipc=host" if shm is None else f"--shm-size={shm}",
             f"--pull={spec.pull}"]
    if memlock:
        start += ["--ulimit=memlock=-1:-1", "--device=/dev/infiniband", "--cap-add=IPC_LOCK"]
    start += [f"--volume={_mount_text(m)}" for m in mounts]
    start += spec.options
    kind = traits(job.backend)
    gpus = () if kind.scheduler_allocates else info.gpus
    if gpus:
        start += _gpu_flags(runtime, gpus)
    enter = [runtime, "exec", f"--workdir={workdir}",
             f"--env=ORCHESTRATE_JOB_ID={job_id}"]
    inside = ",".join(str(i) for i in range(len(gpus))) if gpus else None
    if inside is not None:
        enter.append(f"--env=CUDA_VISIBLE_DEVICES={inside}")
    enter += [f"--env={n}" for n in env if n != "CUDA_VISIBLE_DEVICES" or inside is None]
    if kind.scheduler_env == "slurm":
        enter.append("--env=SLURM*")  # podman reads a trailing * as every such variable
    remove = [runtime, "rm", "--force", *(("--time=0",) if runtime == "podman" else ())]
    return ContainerPlan(
        runtime=runtime, image=image, name=name, start=tuple(start),
        keeper=("--entrypoint=sleep", image, "infinity"), enter=tuple(enter),
        remove=tuple(remove), sources=tuple(m.source for m in spec.parsed_mounts()), env=env,
        gpus=gpus, gpus_from_task=kind.scheduler_allocates and bool(info.gpus),
        cuda_visible_devices=inside,
        ipc=spec.ipc, shm_size=shm, memlock=memlock, python=spec.python,
        host_checks=bool(info.gpus), options=tuple(spec.options))


def _gpu_flags(runtime: str, gpus: tuple[int, ...]) -> list[str]:
    """The planned GPUs: CDI devices (podman, nvidia-container-toolkit's spec), ``--gpus``
    (docker; the quotes keep its CSV parser from splitting the list)."""
    if runtime == "podman":
        return [f"--device=nvidia.com/gpu={i}" for i in gpus]
    return ["--gpus", '"device=' + ",".join(str(i) for i in gpus) + '"']


def _mounts(spec: ContainerSpec, run_dir: str, workdir: str, source: str) -> list[Mount]:
    """The run directory and the workdir at their own paths, then the job's mounts (none of
    which may take the place of those two)."""
    from orchestrate.core.spec.container import Mount

    own = [Mount(source=path, target=path) for path in dict.fromkeys((run_dir, workdir))]
    for i, mount in enumerate(spec.parsed_mounts()):
        if mount.target in (run_dir, workdir):
            raise UserError.single(
                f"mounts something on {mount.target}, where the job's "
                f"{'run directory' if mount.target == run_dir else 'workdir'} is mounted",
                source=source, field=f"container.mounts.{i}", got=mount.text(),
                hint="orchestrate mounts the workdir and the run directory at their own paths; "
                "mount elsewhere")
        own.append(mount)
    return own


def _mount_text(mount: Mount) -> str:
    return mount.text()


def _env_names(job: JobSpec, plan_names: Sequence[str], runtime: str) -> tuple[str, ...]:
    """Every variable passed in by name: the plan's (and the ranks' own), the attempt, the
    secrets, the job's ``container.env``; PYTHONPATH only when the job asks (the image's own
    stays, after the sidecar)."""
    assert job.container is not None
    names: list[str] = []
    wanted = [*plan_names, "RANK", "LOCAL_RANK", "ORCHESTRATE_ATTEMPT", *job.secret_env,
              *job.container.env, *traits(job.backend).container_env]
    for name in wanted:
        if name in names or (name == "ORCHESTRATE_JOB_ID" and runtime in NODE_CONTAINER):
            continue
        if name == "PYTHONPATH" and name not in job.container.env:
            continue
        if runtime == "pyxis" and name == "CUDA_VISIBLE_DEVICES":
            continue  # Slurm's, set by enroot's hooks from the task's GPUs
        names.append(name)
    return tuple(names)


def _image(spec: ContainerSpec, runtime: str, source: str) -> str:
    """The image as the runtime reads it; an image file a runtime cannot run is refused."""
    image = spec.image
    is_path = image.startswith(("/", "./", "../"))
    if runtime in NODE_CONTAINER and image.endswith(_IMAGE_FILES):
        raise UserError.single(
            f"{runtime} runs images from its store or a registry, not a {image.rsplit('.', 1)[1]} "
            "file", source=source, field="container.image", got=image,
            hint="use runtime: pyxis (.sqsh) or apptainer (.sif, .sqsh) on Slurm, or the "
            "image's name for podman/docker (podman load/import puts a file in its store)")
    if runtime == "pyxis":
        if image.endswith((".sif", ".simg")):
            raise UserError.single(
                "pyxis runs docker images and squashfs files (.sqsh), not .sif",
                source=source, field="container.image", got=image,
                hint="use runtime: apptainer for a .sif")
        if is_path or "#" in image:
            return image
        first, sep, rest = image.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            return f"{first}#{rest}"  # enroot's URI: REGISTRY#IMAGE
        return image
    if runtime == "apptainer" and not is_path and "://" not in image:
        return f"docker://{image}"
    return image


def _pyxis_flags(spec: ContainerSpec, image: str, mounts: Sequence[Mount],
                 env: tuple[str, ...], workdir: str) -> tuple[str, ...]:
    """srun's pyxis options (pyxis args.c): the image, the mounts (flags joined by '+'), the
    workdir and every variable the plan sets, kept from the host over the image's values."""
    return (f"--container-image={image}",
            "--container-mounts=" + ",".join(_mount_text(m) for m in mounts),
            f"--container-workdir={workdir}",
            "--container-env=" + ",".join(env),
            *spec.options)


def shm_for(nproc: int) -> int:
    """The default ``/dev/shm`` of a private IPC namespace: 1 GiB per rank on the node."""
    return max(1, nproc) * GiB


__all__ = ["NODE_CONTAINER", "RANK_MARK", "ContainerPlan", "NodeInfo",
           "container_name", "plan_container", "runtime_for", "shm_for"]
