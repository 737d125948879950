"""The job file's ``container:`` section: the image the ranks run in, and how.

::

    container:
      image: registry.example.org/org/train:2.13   # or a local image, a .sqsh or .sif path
      runtime: podman          # podman | docker (local, ssh; slurm: podman) | pyxis | apptainer
      mounts: [/data:/data:ro] # SRC:DST[:ro|rw]; the workdir and run directory always go in
      env: [HF_HOME]           # host variables passed in; the plan's own always are
      ipc: host                # or private, with /dev/shm sized by shm_size (default 1g a rank)
      python: python3          # what "python" in the command means inside the image
      pull: missing            # podman/docker: missing | never | always
      options: []              # more arguments for the runtime (docs/containers.md)

What each runtime gets, per node, is decided by the planner
(:mod:`orchestrate.core.plan.container`); this module only reads and checks what the file says,
in the file's own terms: paths absolute,
mount modes that every runtime understands, and no ``shm_size`` with the host's IPC namespace
(podman refuses the pair: "cannot set shmsize when running in the host IPC Namespace").
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from orchestrate.core.spec.schema import Spec

ContainerRuntime = Literal["podman", "docker", "pyxis", "apptainer"]
#: A variable name (the same rule as the job's ``env``).
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: podman's and docker's ``--shm-size``: a number and an optional unit (b, k, m, g).
_SIZE = re.compile(r"^([1-9][0-9]*)([bkmg]?)$", re.IGNORECASE)
#: The mount modes all four runtimes read the same way (podman/docker ``-v``, pyxis
#: ``--container-mounts``, apptainer ``--bind``).
MOUNT_MODES = ("ro", "rw")


class Mount(Spec):
    """One ``SRC:DST[:MODE]`` of ``container.mounts``, parsed."""

    source: str
    target: str
    mode: str | None = None

    def text(self) -> str:
        """Back as ``SRC:DST[:MODE]``."""
        return f"{self.source}:{self.target}" + (f":{self.mode}" if self.mode else "")


def parse_mount(text: str) -> Mount:
    """``/data:/data:ro`` -> its parts, or ValueError saying what is wrong with it."""
    if not text.isprintable() or any(ch.isspace() for ch in text):
        raise ValueError(f"{text!r}: no spaces or control characters in a mount")
    if "," in text:
        raise ValueError(f"{text!r}: ',' separates mounts for pyxis and apptainer; one mount "
                         "per item")
    parts = text.split(":")
    if len(parts) == 1:
        parts.append(parts[0])
    if len(parts) > 3 or not parts[0] or not parts[1]:
        raise ValueError(f"{text!r}: a mount is SRC:DST or SRC:DST:MODE")
    source, target = parts[0], parts[1]
    mode = parts[2] if len(parts) == 3 else None
    for path in (source, target):
        if not path.startswith("/"):
            raise ValueError(f"{text!r}: {path} is not an absolute path")
    if mode is not None and mode not in MOUNT_MODES:
        raise ValueError(f"{text!r}: the mode is ro or rw (got {mode!r})")
    return Mount(source=source.rstrip("/") or "/", target=target.rstrip("/") or "/", mode=mode)


def shm_bytes(size: str) -> int:
    """``16g`` -> bytes (podman's and docker's units: powers of 1024)."""
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"not a size: {size!r}")
    unit = match.group(2).lower()
    return int(match.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]


class ContainerSpec(Spec):
    """The job's container (see the module docstring)."""

    image: str = Field(min_length=1, description="an image name, or a .sqsh/.sif path")
    runtime: ContainerRuntime | None = Field(
        default=None, description="default: podman (or docker) where found on local and ssh "
        "nodes, pyxis on Slurm")
    mounts: list[str] = Field(
        default_factory=list, description="SRC:DST[:ro|rw], absolute paths; the workdir and "
        "the run directory are always mounted at their own paths")
    env: list[str] = Field(
        default_factory=list, description="host variables passed in by name (the plan's own "
        "variables always are)")
    ipc: Literal["host", "private"] = Field(
        default="host", description="host: the host's IPC namespace and /dev/shm (what NCCL "
        "and CUDA IPC need); private: a /dev/shm of shm_size")
    shm_size: str | None = Field(
        default=None, description="/dev/shm with ipc: private, e.g. 16g (default 1g per rank "
        "on the node)")
    python: str = Field(default="python3", min_length=1,
                        description="the interpreter 'python' in the command means inside")
    pull: Literal["missing", "never", "always"] = Field(
        default="missing", description="podman and docker: when to pull the image")
    options: list[str] = Field(
        default_factory=list, description="more arguments for the runtime's command (podman/"
        "docker run, srun for pyxis, apptainer exec)")

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not value.isprintable() or any(ch.isspace() for ch in value):
            raise ValueError("an image is one word: no spaces or control characters")
        if value.startswith("-"):
            raise ValueError("an image cannot start with '-' (it would read as an option)")
        return value

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value: list[str]) -> list[str]:
        targets: dict[str, str] = {}
        for item in value:
            mount = parse_mount(item)
            if mount.target in targets:
                raise ValueError(f"{item!r} and {targets[mount.target]!r} both mount on "
                                 f"{mount.target}")
            targets[mount.target] = item
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.startswith("ORCHESTRATE_"):
                raise ValueError(f"{name}: orchestrate's own variables are always passed")
        return value

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if _SIZE.match(value) is None:
            raise ValueError("a size like 16g, 512m or 1073741824 (bytes)")
        if info.data.get("ipc", "host") == "host":
            raise ValueError(
                "shm_size needs ipc: private: with ipc: host /dev/shm is the host's, and podman "
                "refuses the pair ('cannot set shmsize when running in the host IPC "
                "Namespace'); drop shm_size, or set ipc: private")
        return value

    @field_validator("python")
    @classmethod
    def _python(cls, value: str) -> str:
        if not value.isprintable() or any(ch.isspace() for ch in value):
            raise ValueError("a program name or path, without spaces")
        return value

    @field_validator("options")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.isprintable():
                raise ValueError(f"{item!r}: no line breaks or control characters")
        return value

    def parsed_mounts(self) -> tuple[Mount, ...]:
        """``mounts``, parsed."""
        return tuple(parse_mount(m) for m in self.mounts)


__all__ = ["MOUNT_MODES", "ContainerRuntime", "ContainerSpec", "Mount", "parse_mount",
           "shm_bytes"]
