"""The text of a ``command:`` job's own program and config files, read (never imported) at
load time for what the plan should know of them: framework-level FSDP
(:mod:`orchestrate.core.plan.frameworkfsdp`).

Which files: the command's words (and the words of a ``sh -c``/``bash -c`` string) that name a
``.py``, ``.yaml``, ``.yml``, ``.json`` or ``.toml`` file, and ``python -m MODULE``'s module,
relative to the workdir; those that exist, at most :data:`MAX_FILES` of them and
:data:`MAX_BYTES` each. A file that cannot be read is skipped: this is advice, never a refusal.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrate.core.plan.frameworkfsdp import signs_in, signs_in_env

MAX_FILES = 16
MAX_BYTES = 1 << 20
_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".toml")
_SHELLS = ("sh", "bash", "dash", "zsh")


def _words(command: Sequence[str]) -> list[str]:
    words = list(command)
    for i, word in enumerate(command[:-1]):
        if Path(word).name in _SHELLS and command[i + 1] == "-c" and i + 2 < len(command):
            try:
                words += shlex.split(command[i + 2])
            except ValueError:
                words += command[i + 2].split()
    return words


def program_files(command: Sequence[str], workdir: Path) -> list[Path]:
    """The program and config files ``command`` names that exist (see the module docstring)."""
    words = _words(command)
    names = [w.split("=", 1)[-1] for w in words if w.split("=", 1)[-1].endswith(_SUFFIXES)]
    for i, word in enumerate(words[:-1]):
        if word == "-m":
            module = words[i + 1].replace(".", "/")
            names += [f"{module}.py", f"{module}/__main__.py"]
    found: list[Path] = []
    for name in dict.fromkeys(names):
        path = workdir / Path(name).expanduser()
        if path.is_file() and path not in found:
            found.append(path)
    return found[:MAX_FILES]


def fsdp_signs(command: Sequence[str] | None, env: Mapping[str, object], workdir: Path
               ) -> list[str]:
    """Every framework-level FSDP sign in the job's files and ``env:``, as ``where: what``."""
    signs = [s.shown() for s in signs_in_env(env)]
    for path in program_files(command or (), workdir):
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read(MAX_BYTES)
        except OSError:
            continue
        name = str(path.relative_to(workdir)) if path.is_relative_to(workdir) else str(path)
        signs += [s.shown() for s in signs_in(name, text)]
    return signs
