"""Optional dependencies: which extra of orchestrate installs each, and the one error that says
so.

Fabric (with paramiko and invoke) for SSH, submitit for ``submit_function``, torch for training
and the model probe, scikit-learn for the examples are extras (``pip install
'orchestrate[ssh]'``), so that a Slurm-only or local-only install stays small. Without this, a
missing extra surfaced where it was first imported: a traceback, or per host in ``inventory
probe`` as ``ModuleNotFoundError: paramiko``. Here every such import maps to one sentence that
names the pip command (exit 2): :func:`require` before the work starts, where the command knows
which extra it needs, and :func:`missing` for an ImportError that reaches the CLI anyway.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from orchestrate.core.errors import UserError

#: The optional modules orchestrate imports, by top-level name, and the extra that installs each.
EXTRAS: Mapping[str, str] = {
    "fabric": "ssh", "paramiko": "ssh", "invoke": "ssh",
    "submitit": "slurm",
    "torch": "train",
    "sklearn": "examples",
}


def install_hint(extra: str) -> str:
    """``install it with: pip install 'orchestrate[ssh]'`` (and the form for a checkout)."""
    return (f"install it with: pip install 'orchestrate[{extra}]' "
            f"(in a checkout of orchestrate: pip install -e '.[{extra}]')")


def _error(module: str, extra: str, needed_for: str) -> UserError:
    return UserError.single(
        f"{needed_for} needs {module} (orchestrate's [{extra}] extra), which is not installed "
        "in this Python", hint=install_hint(extra))


def missing(exc: ImportError, needed_for: str = "this command") -> UserError | None:
    """The error for an ImportError of an optional module (None for any other module)."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    return None if extra is None else _error(name, extra, needed_for)


def require(extra: str, needed_for: str) -> None:
    """Refuse (exit 2, naming the pip command) when a module of ``extra`` is not installed;
    looked up, not imported, so it costs microseconds."""
    for module, of in EXTRAS.items():
        if of == extra and _absent(module):
            raise _error(module, extra, needed_for)


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken install, or a module without a spec
        return True
