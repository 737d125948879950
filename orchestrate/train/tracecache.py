"""The model probe's answers kept per job, so that ``plan`` then ``submit`` trace once.

Tracing a 7 B-shaped model takes 20-40 s of CPU a plan; ``submit`` of the job just planned
asked again for the same numbers. The probe's answers (the model's facts and every traced peak)
are kept in the user's own state directory (``$ORCHESTRATE_HOME``, ``$XDG_STATE_HOME/orchestrate``
or ``~/.local/state/orchestrate``, private to the user: ``traces/``, mode 0700), one file per
key. The key is what the answers depend on: the ``train:`` section (the model, dataset and loss
factories and their arguments, precision, optimizer, batch, strategy, ``fsdp:``; not the
deadline, the length of the run or the learning rate), the
layouts asked for, the workdir, the contents of the factories' modules found in the workdir, the
probe's own source and the torch version. Only complete answers are kept (a failure or a
deadline is asked again next time). An edit to a factory's module elsewhere (an installed
package) is not seen: ``ORCHESTRATE_TRACE_CACHE=0`` turns the cache off.

Files are opened without following links, must be the user's own regular files, are written to
a temporary name and renamed, and are read up to :data:`MAX_BYTES`; anything else is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from importlib import metadata
from pathlib import Path
from typing import Any

from orchestrate.hostside.host import state_dir

MAX_BYTES = 1 << 20
_PROBE_SOURCES = ("modelprobe.py", "sharding.py", "build.py", "precision.py")
#: Fields of ``train:`` that change no traced byte (the deadline, how long, the learning rate)
_NO_MEMORY = ("memory_trace_s", "epochs", "max_steps")


def enabled() -> bool:
    return os.environ.get("ORCHESTRATE_TRACE_CACHE", "1") != "0"


def _module_files(path: str, workdir: Path) -> list[Path]:
    """The workdir's file of the module ``path`` (``pkg.mod:fn``) names, if it is there."""
    module = path.partition(":")[0]
    if not module:
        return []
    base = workdir.joinpath(*module.split("."))
    return [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]


def _digest(paths: list[Path]) -> dict[str, str]:
    out: dict[str, str] = {}
    for path in paths:
        try:
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            out[str(path)] = "unreadable"
    return out


def key(train: dict[str, Any], requests: list[dict[str, Any]], workdir: Path) -> str | None:
    """The cache key of these probe requests, or None when torch's version is unknown."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    factories = [str(train.get(k) or "") for k in ("model", "dataset", "loss")]
    train = {k: v for k, v in train.items() if k not in _NO_MEMORY}
    if isinstance(train.get("optimizer"), dict):
        train["optimizer"] = {k: v for k, v in train["optimizer"].items() if k != "lr"}
    here = Path(__file__).resolve().parent
    material = {
        "train": train, "requests": requests, "workdir": str(workdir.resolve()),
        "torch": torch_version,
        "user": _digest([p for f in factories for p in _module_files(f, workdir)]),
        "probe": _digest([here / name for name in _PROBE_SOURCES]),
    }
    text = json.dumps(material, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _folder() -> Path | None:
    """``traces/`` in the state directory, when it is the user's own private folder."""
    try:
        folder = Path(state_dir()) / "traces"
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return folder


def load(name: str) -> list[str] | None:
    """The answer lines kept under ``name``, or None."""
    folder = _folder()
    if folder is None:
        return None
    try:
        fd = os.open(folder / f"{name}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        return None
    try:
        lines = json.loads(data)
    except ValueError:
        return None
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        return None
    return lines


def save(name: str, lines: list[str]) -> None:
    """Keep ``lines`` under ``name`` (best effort: a cache that cannot be written is no cache)."""
    folder = _folder()
    if folder is None:
        return
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(lines, f)
        os.replace(tmp, folder / f"{name}.json")
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


__all__ = ["enabled", "key", "load", "save"]
