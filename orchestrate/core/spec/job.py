"""The job file: what to run, on how much of the inventory, and how.

:func:`load_job` reads the YAML, applies ``--set`` overrides (type-checked like the file) and
validates into :class:`JobSpec`. Paths inside the file are relative to the file.
"""

from __future__ import annotations

import re
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from orchestrate.core.errors import UserError
from orchestrate.core.spec import overrides as overrides_module
from orchestrate.core.spec.container import ContainerSpec
from orchestrate.core.spec.frameworks import Framework
from orchestrate.core.spec.loader import Lines, read_yaml, validate
from orchestrate.core.spec.restartspec import RestartPolicy
from orchestrate.core.spec.schema import (
    Bool,
    Float,
    Int,
    MaybeFloat,
    MaybeInt,
    Spec,
    not_boolean,
    single_line,
)
from orchestrate.core.spec.trainspec import TrainSpec

Backend = Literal["local", "slurm", "ssh"]
#: How a node's processes start (docs/launchers.md): ``ranks``, one process per rank with the
#: torchrun environment; ``per_node``, one process per node that starts its own workers
#: (``torch.multiprocessing.spawn``); ``torchrun``, orchestrate runs the node's
#: ``torch.distributed.run`` with the plan's static rendezvous.
Launcher = Literal["ranks", "per_node", "torchrun"]

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
#: Set per rank or per node by the planner; one value in the job's env cannot be right for all.
PER_RANK_ENV = ("RANK", "LOCAL_RANK")
PER_NODE_ENV = ("GROUP_RANK", "LOCAL_WORLD_SIZE")
#: Set by the planner from the resources and the inventory; a value in the job's env would
#: silently override the plan (the ranks would build a world, or use GPUs, that no table
#: shows). Each with where the job says it instead.
PLAN_ENV = {
    "CUDA_VISIBLE_DEVICES": "the planner sets it to the node's chosen GPUs (PCI bus order): "
                            "choose them with resources.gpus_per_node, gpu_model or "
                            "min_gpu_memory_gb, or the inventory's CUDA indices",
    "WORLD_SIZE": "the planner sets it from resources (the ranks of every node)",
    "MASTER_ADDR": "set distributed.master_addr instead",
    "MASTER_PORT": "set distributed.master_port instead",
}
#: orchestrate's own variables (the job's tag that finds its processes, its run directory, ...):
#: a job that set them would escape cancel or write elsewhere.
RESERVED_PREFIX = "ORCHESTRATE_"


def check_job_id(value: str) -> str:
    """Job ids (``--job-id``) follow job names: a file name, never a path."""
    if not _JOB_NAME.match(value):
        raise ValueError("letters, digits, '.', '_' and '-' (at most 64), starting alnum")
    return value


def time_limit_seconds(limit: str) -> int:
    """Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    match = _TIME.match(limit)
    if match is None:
        raise ValueError(f"not a Slurm time limit: {limit!r}")
    days, first, second, third = match.groups()
    if days is not None:
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if third is not None:
        return (int(first) * 60 + int(second)) * 60 + int(third)
    if second is not None:
        return int(first) * 60 + int(second)
    return int(first) * 60


def wait_seconds(wait: bool | str) -> float | None:
    """``resources.wait`` as seconds: None (do not wait), ``inf`` (no bound) or the bound."""
    return None if wait is False else (
        float("inf") if wait is True else float(time_limit_seconds(wait)))


def plain_text(value: str) -> str:
    """Text that can reach a script, an environment or a command line: UTF-8, no NUL byte."""
    if "\0" in value:
        raise ValueError("a NUL character cannot be passed to a program")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (a lone surrogate)") from None
    return value


#: ``resources.placement``: how the planner picks among a node's free GPUs (core/plan/gpuchoice).
Placement = Literal["pack", "spread", "any"]


class Resources(Spec):
    """How much of the inventory the job takes."""

    nodes: Int = Field(default=1, ge=1)
    gpus_per_node: Annotated[int | Literal["all"], not_boolean("a whole number or 'all'")] = (
        Field(default="all", description="GPUs per node, or processes on CPU-only nodes"))
    gpu_model: str | None = None
    min_gpu_memory_gb: MaybeFloat = Field(default=None, gt=0)
    node_names: list[str] | None = None
    allow_mixed_gpus: Bool = False
    time: str | None = Field(
        default=None,
        description="time limit, e.g. 02:00:00 (Slurm's formats; a bare number is minutes); "
        "enforced on every backend",
    )
    cpus_per_task: MaybeInt = Field(default=None, ge=1)
    mem_gb: MaybeFloat = Field(default=None, gt=0, description="memory per node")
    share_gpus: Bool = Field(
        default=False,
        description="local and SSH: may use GPUs that processes outside orchestrate use, "
        "counting their free memory (default: such GPUs are busy)",
    )
    placement: Placement = Field(
        default="pack", description="which free GPUs of a node: pack (one NUMA node, then one "
        "PCIe switch or NVLink island), spread (across NUMA nodes), any (the first free)")
    wait: Annotated[bool | str, Field(
        description="local and SSH: when what the job needs is held by others, wait for it "
        "(PENDING, first come first served) instead of exiting 75: true, or for at most a "
        "time (Slurm's formats, e.g. '30' or '02:00:00')")] = False

    @field_validator("wait", mode="before")
    @classmethod
    def _wait(cls, value: object) -> object:
        with suppress(ValueError):
            if isinstance(value, bool) or (isinstance(value, str) and time_limit_seconds(value)):
                return value
        raise ValueError("a boolean (true: no bound), or how long to wait as a string: "
                         "'MM', 'HH:MM:SS' or 'D-HH:MM:SS'")

    @field_validator("gpus_per_node")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or 'all'")
        return value

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # minutes, as Slurm reads a bare number
        if isinstance(value, str):
            try:
                seconds = time_limit_seconds(value)
            except ValueError:
                raise ValueError("a time limit looks like MM, HH:MM:SS or D-HH:MM:SS") from None
            if seconds <= 0:
                raise ValueError("a time limit must be more than 0")
        return value


class Distributed(Spec):
    """How ranks find each other and how long they wait."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    master_port: Annotated[int | Literal["auto"], not_boolean("a port or 'auto'")] = "auto"
    master_addr: str | None = Field(
        default=None, description="the master's address as the ranks reach it (default: the "
        "first node's address; on Slurm, its host)")
    timeout_s: Float = Field(default=600.0, gt=0, le=86400)
    omp_num_threads: MaybeInt = Field(default=None, ge=1)
    #: A job is stalled when no rank made progress (a step, a collective, a phase) for this
    #: long, or a live rank's heartbeat stopped; then every rank's stacks and collectives are
    #: collected and the stuck rank named (docs/hangs.md). 0 turns the watch off.
    stall_s: Float = Field(default=120.0, ge=0, le=86400)
    #: How long a rank that is busy without progress does not count as stalled: in the
    #: trainer's checkpoint or eval phase, blocked in file I/O (slow storage), or computing
    #: outside any collective (docs/hangs.md). Never less than ``stall_s``.
    busy_s: Float = Field(default=1800.0, gt=0, le=7 * 86400)
    #: What a stall does: ``report`` (name the rank, keep running: the process-group timeout
    #: still ends it) or ``kill`` (stop the job, an ending that ``restart.on: [stall]`` restarts).
    on_stall: Literal["report", "kill"] = "report"
    #: The per-rank sidecar (heartbeats, stacks on request) in every Python rank.
    sidecar: Bool = True
    #: What a process group formed with a rank or world size other than the plan's does
    #: (seen by the sidecar at init_process_group: the program built its own world):
    #: ``kill`` stops the job (FAILED, never restarted), ``report`` says so and goes on.
    on_wrong_world: Literal["kill", "report"] = "kill"

    @field_validator("master_addr")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(c.isspace() for c in value)):
            raise ValueError("a host name or an IP address, without spaces")
        return value

    @field_validator("stall_s")
    @classmethod
    def _stall(cls, value: float) -> float:
        if 0 < value < 10:
            raise ValueError("at least 10 seconds (heartbeats come every few seconds), or 0 "
                             "to turn the stall watch off")
        return value

    @field_validator("busy_s")
    @classmethod
    def _busy(cls, value: float, info: ValidationInfo) -> float:
        stall = info.data.get("stall_s")
        if isinstance(stall, float) and value < stall:
            raise ValueError(f"at least distributed.stall_s ({stall:g} s): busy ranks get more "
                             "time than a stall, never less")
        return value

    @field_validator("master_port")
    @classmethod
    def _port(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1024 <= value <= 65535:
            raise ValueError("a port between 1024 and 65535, or 'auto'")
        return value


_SIGNALS = ("USR2", "TERM", "INT", "HUP", "URG")


class SlurmJob(Spec):
    """Slurm settings of the job (with the node's partition as a fallback)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    extra_args: list[str] = Field(default_factory=list)
    signal: str = Field(default="USR2", description="sent before the time limit; never USR1")
    signal_seconds_before: Int = Field(default=120, ge=1)
    max_restarts: MaybeInt = Field(
        default=None, description="replaced by restart.max (kept only to say so)")
    requeue_on_node_failure: Bool | None = Field(
        default=None, description="replaced by restart.on: [node_lost] (kept only to say so)")
    gres_type: str | None = None

    @field_validator("max_restarts")
    @classmethod
    def _moved_max(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError(
                f"is now restart.max, the restart budget of every backend: write "
                f"'restart: {{max: {value}, on: [requeue, node_lost]}}' for what it did "
                "(restart after a checkpoint on the stop signal, or a lost node), or "
                f"'restart: {{max: {value}}}' to restart a failed rank too")
        return value

    @field_validator("requeue_on_node_failure")
    @classmethod
    def _moved_node_failure(cls, value: bool | None) -> bool | None:
        if value is not None:
            kept = "keep 'node_lost' in" if value else "leave 'node_lost' out of"
            raise ValueError(f"is now part of restart.on: {kept} restart.on "
                             "(it is in the default [requeue, node_lost])")
        return value

    @field_validator("partition", "account", "qos", "gres_type")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        return None if value is None else single_line(value)

    @field_validator("extra_args")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        return [single_line(arg) for arg in value]

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: str) -> str:
        name = value.upper().removeprefix("SIG")
        if name == "USR1":
            raise ValueError("NCCL uses SIGUSR1; use USR2 (the default) or TERM")
        if name not in _SIGNALS:
            raise ValueError(f"one of {', '.join(_SIGNALS)}")
        return name


class Logs(Spec):
    """What the job's output may take on disk."""

    max_mb_per_rank: MaybeFloat = Field(
        default=None, gt=0, le=10**7,
        description="what one rank may print per attempt, in MB (2**20 bytes); past it the "
        "rest is dropped, and the log says so; default: no cap")

    @property
    def cap_bytes(self) -> int | None:
        """The cap in bytes (None: none)."""
        return None if self.max_mb_per_rank is None else int(self.max_mb_per_rank * (1 << 20))


class SSHJob(Spec):
    """SSH fan-out settings of the job."""

    fanout: Int = Field(default=32, ge=1, description="hosts contacted at once, like pdsh")
    connect_timeout_s: Float = Field(default=10.0, gt=0)


class JobSpec(Spec):
    """The job file."""

    name: str
    inventory: str | None = Field(
        default=None, description="inventory path relative to this file; local: this machine"
    )
    backend: Backend = "local"
    resources: Resources = Field(default_factory=Resources)
    train: TrainSpec | None = None
    command: list[str] | None = None
    env: dict[str, str | int | float | bool] = Field(default_factory=dict)
    secret_env: list[str] = Field(
        default_factory=list,
        description="names taken from the submitting environment; never on a command line or "
        "in the job's record (docs/slurm.md: how Slurm jobs get them)",
    )
    distributed: Distributed = Field(default_factory=Distributed)
    launcher: Launcher = Field(
        default="ranks",
        description="how each node's processes start: ranks (one process per rank, the "
        "default), per_node (one process per node that starts its own workers, e.g. "
        "torch.multiprocessing.spawn) or torchrun (orchestrate runs torch.distributed.run on "
        "every node with the plan's rendezvous); docs/launchers.md",
    )
    framework: Framework = Field(
        default="none",
        description="the training framework the command uses, so that `plan` refuses layouts "
        "it cannot run and says what to pass it (docs/frameworks.md); the environment is the "
        "same either way",
    )
    slurm: SlurmJob = Field(default_factory=SlurmJob)
    ssh: SSHJob = Field(default_factory=SSHJob)
    container: ContainerSpec | None = Field(
        default=None, description="run the ranks in a container image (docs/containers.md)")
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    logs: Logs = Field(default_factory=Logs)
    workdir: str | None = Field(default=None, description="where ranks run; default: this file's")
    templates_dir: str | None = None
    run_root: str | None = Field(default=None, description="where run directories go")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _JOB_NAME.match(value):
            raise ValueError("letters, digits, '.', '_' and '-' (at most 64), starting alnum")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            _check_env_name(key)
            if isinstance(item, str):
                try:
                    plain_text(item)
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        for key in value:
            _check_env_name(key)
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("the command is empty")
        for arg in value or []:
            plain_text(arg)
        return value

    @field_validator("workdir", "run_root", "templates_dir", "inventory")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return None if value is None else plain_text(value)

    @model_validator(mode="after")
    def _train_or_command(self) -> JobSpec:
        if (self.train is None) == (self.command is None):
            raise ValueError("give exactly one of 'train' (the shared entrypoint) or 'command'")
        clash = set(self.secret_env) & set(self.env)
        if clash:
            raise ValueError(f"{', '.join(sorted(clash))} is both in 'env' and 'secret_env'")
        return self


def _check_env_name(key: str) -> None:
    if not _ENV_NAME.match(key):
        raise ValueError(f"{key!r} is not an environment variable name")
    for names, unit in ((PER_RANK_ENV, "rank"), (PER_NODE_ENV, "node")):
        if key in names:
            raise ValueError(f"{key} is set per {unit} by the planner and cannot be overridden")
    if key in PLAN_ENV:
        raise ValueError(f"{key} would silently override the plan: {PLAN_ENV[key]}")
    if key.startswith(RESERVED_PREFIX):
        raise ValueError(f"{key}: variables starting with {RESERVED_PREFIX} are orchestrate's "
                         "own (the job's tag, its run directory, ...)")


def load_job(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a job file, apply ``--set`` overrides and validate."""
    return read_job(path, overrides)[0]


def read_job(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobSpec, Lines]:
    """:func:`load_job`, and the file's line of each field (for later checks' errors)."""
    data, lines = read_yaml(path)
    if isinstance(data, dict):
        in_file = {key for key in ("train", "command") if key in data}
        data = apply_overrides(data, overrides)
        _check_one_entrypoint(data, in_file, overrides)
    try:
        return validate(JobSpec, data, str(path), lines), lines
    except UserError as exc:
        raise UserError(overrides_module.blame(exc.problems, overrides)) from None


def _check_one_entrypoint(data: dict[str, Any], in_file: set[str],
                          overrides: list[str] | tuple[str, ...]) -> None:
    """``--set train.epochs=3`` on a ``command:`` job adds a second entrypoint: say that it
    was ``--set`` (the model's own check would blame the whole file)."""
    given = [key for key in ("train", "command") if key in data and key not in in_file]
    if given and {"train", "command"} <= set(data):
        items = [o for o in overrides if o.partition("=")[0].split(".")[0] == given[0]]
        raise UserError.single(
            f"the file's job has '{next(iter(in_file))}', and --set adds '{given[0]}': a job "
            "has exactly one of 'train' (the shared entrypoint) or 'command'",
            source="--set", field=given[0], got=", ".join(items) or None,
            hint=f"drop the --set of {given[0]}.*, or remove '{next(iter(in_file))}' from the file",
        )


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``field.path=value`` overrides to a job's data (:func:`overrides.apply`)."""
    return overrides_module.apply(JobSpec, data, overrides)


def job_dir(path: Path) -> Path:
    """The folder relative paths in a job file are resolved against."""
    return path.resolve().parent


__all__ = ["Backend", "Distributed", "JobSpec", "Launcher", "Lines", "Resources", "SSHJob",
           "SlurmJob", "apply_overrides", "job_dir", "load_job", "read_job"]
