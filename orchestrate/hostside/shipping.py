"""Programs shipped to other machines as source text: several stdlib-only modules, one program.

The SSH agent, the Slurm batch job's monitor and the local watchdog run where orchestrate may not
be installed (a bare server, a compute node) or must not be imported (``python -S``: no
site-packages, a third of the start-up), so orchestrate sends their text and the interpreter
there runs it (``python -S -c TEXT``, or a file in the run directory). Such a program is made of
modules of this package that use the standard library only, carried *as modules*: their sources
travel in a dict, and a small import hook (the first thing the program installs) serves them
under their own names, each in its own namespace. So a shipped module is written, imported,
type-checked and tested like any other (``from orchestrate.hostside.host import reap``), and two of
them may define the same name. No other orchestrate module can be imported there: a shipped module
that needs one that is not shipped fails at once, in the tests that run every program.

:data:`SHIPPED` is the one registry of what is shipped: every program, and the modules it
carries. Each module named there uses the standard library only and runs on Python 3.8+ (ruff
checks them at that target, and a test compiles and runs every program on 3.8). Importing this
module costs nothing beyond the standard library.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import import_module
from pathlib import Path

#: Every program orchestrate ships, by name: the modules it carries, innermost first.
SHIPPED: dict[str, tuple[str, ...]] = {
    # The SSH agent, one per host and job (backends/ssh/channels.py), sent as ``python -S -c``.
    "agent": ("orchestrate.hostside.host", "orchestrate.hostside.containment",
              "orchestrate.hostside.smi", "orchestrate.hostside.gpuuse",
              "orchestrate.hostside.bookdir",
              "orchestrate.hostside.leases",
              "orchestrate.hostside.watchdog", "orchestrate.core.exits",
              "orchestrate.core.plan.outcome", "orchestrate.core.plan.restart",
              "orchestrate.backends.ssh.agent"),
    # What an SSH host runs to read its ranks' heartbeats and dumps (``evidence.py``).
    "evidence": ("orchestrate.core.layout", "orchestrate.diagnosis.kernelstate",
                 "orchestrate.diagnosis.diagfiles",
                 "orchestrate.diagnosis.stallrule", "orchestrate.diagnosis.stacks",
                 "orchestrate.diagnosis.stall", "orchestrate.diagnosis.evidence"),
    # The Slurm batch job's ``monitor.py``: logs, the stall watch and the end of a run.
    "monitor": ("orchestrate.core.exits", "orchestrate.core.plan.outcome",
                "orchestrate.core.plan.restart", "orchestrate.core.layout",
                "orchestrate.core.plan.workers",
                "orchestrate.diagnosis.kernelstate", "orchestrate.diagnosis.diagfiles",
                "orchestrate.diagnosis.stallrule",
                "orchestrate.diagnosis.stacks", "orchestrate.diagnosis.stall",
                "orchestrate.diagnosis.evidence", "orchestrate.diagnosis.world",
                "orchestrate.diagnosis.hangwatch", "orchestrate.hostside.outputlog",
                "orchestrate.backends.slurm.monitor"),
    # The local supervisor's watchdog (backends/detached.py).
    "watchdog": ("orchestrate.hostside.host", "orchestrate.hostside.containment",
                 "orchestrate.hostside.smi", "orchestrate.hostside.gpuuse",
                 "orchestrate.hostside.bookdir",
                 "orchestrate.hostside.leases",
                 "orchestrate.hostside.watchdog"),
    # ``inventory probe`` and the doctor's facts, on every node (probe/gathering.py).
    "gatherer": ("orchestrate.hostside.smi", "orchestrate.hostside.hostfacts"),
    # Every rank's sidecar: the modules of ``sidecar/_orchestrate_rank/``, copied as files
    # under their last names (orchestrate/diagnosis/rankpackage.py), not bundled.
    "sidecar": ("orchestrate.core.layout", "orchestrate.hostside.timeouts",
                "orchestrate.diagnosis.kernelstate", "orchestrate.diagnosis.diagfiles",
                "orchestrate.diagnosis.threadstate",
                "orchestrate.diagnosis.workers", "orchestrate.diagnosis.flightrecorder",
                "orchestrate.diagnosis.joinwatch", "orchestrate.diagnosis.activation",
                "orchestrate.diagnosis.sidecar"),
}


def shipped(name: str, entry: str) -> str:
    """The program called ``name`` in :data:`SHIPPED`, running ``entry`` (Python statements)."""
    return program(SHIPPED[name], entry)


#: Serves the shipped sources as modules (run first, before the entry code).
_BOOTSTRAP = '''\
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.util import spec_from_loader


class _Shipped(MetaPathFinder, Loader):
    """The modules this program carries, under their own names."""

    def find_spec(self, name, path=None, target=None):
        if name in _SOURCES or name in _PACKAGES:
            return spec_from_loader(name, self, is_package=name in _PACKAGES)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        source = _SOURCES.get(module.__name__)
        if source is None:  # a package that only holds shipped modules
            module.__path__ = []
            return
        exec(compile(source, "<shipped " + module.__name__ + ">", "exec"), module.__dict__)


sys.meta_path.insert(0, _Shipped())
'''


@lru_cache(maxsize=64)
def module_source(name: str) -> str:
    """A module's source text."""
    path = import_module(name).__file__
    if path is None:  # pragma: no cover - namespace packages have no file
        raise ValueError(f"{name} has no source file")
    return Path(path).read_text(encoding="utf-8")


@lru_cache(maxsize=16)
def program(modules: tuple[str, ...], entry: str) -> str:
    """One program carrying ``modules`` and running ``entry`` (Python statements, e.g.
    ``from orchestrate.hostside.host import watch; watch(...)``) once they can be imported."""
    packages = sorted({name.rsplit(".", depth)[0] for name in modules
                       for depth in range(1, name.count(".") + 1)})
    sources = "{\n" + "".join(f"    {name!r}: {module_source(name)!r},\n"
                              for name in modules) + "}"
    return (f"# A program shipped by orchestrate: the modules {', '.join(modules)}.\n"
            f"_SOURCES = {sources}\n_PACKAGES = {tuple(packages)!r}\n"
            + _BOOTSTRAP + "\n" + entry.rstrip() + "\n")
