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

Each program is declared by the module that ships it, as a :class:`Manifest` of the *module
objects* it carries (the agent's in ``backends/ssh/channels.py``, the monitor's in
``backends/slurm/script.py``, ...): this bottom layer never names, and never imports, a module
of the layers above it; it only reads the files of the modules it is handed. So moving a
shipped module is an ordinary import change that mypy and the import system check, and
``tests/core/test_core_shipped.py`` finds every manifest (by reading the sources) and checks
that each module named there uses the standard library only and runs on Python 3.8+ (ruff
checks them at that target, and a test compiles every program on 3.8). Importing this module
costs nothing beyond the standard library.

**One argument holds at most 128 KiB** on Linux (``MAX_ARG_STRLEN``, whatever ``ARG_MAX``
says), and sshd hands the whole remote command to the login shell as one: the SSH agent's text
grew to 174 KB and every SSH job failed with "bash: Argument list too long". A program sent on a
command line goes as :func:`compact` text (zlib, base85: the agent's is 64 KB), which unpacks
and runs it; ``tests/core/test_core_shipped.py`` checks every program's command line against
:data:`MAX_ARGUMENT`.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType


@dataclass(frozen=True)
class Manifest:
    """One shipped program: its name and the modules it carries, innermost first. Declared at
    module level by the module that ships it (the tests find it there)."""

    name: str
    modules: tuple[ModuleType, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The carried modules' import names."""
        return tuple(module.__name__ for module in self.modules)


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
def module_source(module: ModuleType) -> str:
    """A module's source text, read from its file (the module is the caller's: nothing is
    imported here)."""
    path = module.__file__
    if path is None:  # pragma: no cover - namespace packages have no file
        raise ValueError(f"{module.__name__} has no source file")
    return Path(path).read_text(encoding="utf-8")


@lru_cache(maxsize=16)
def program(manifest: Manifest, entry: str) -> str:
    """One program carrying ``manifest``'s modules and running ``entry`` (Python statements,
    e.g. ``from orchestrate.hostside.host import watch; watch(...)``) once they can be
    imported."""
    names = manifest.names
    packages = sorted({name.rsplit(".", depth)[0] for name in names
                       for depth in range(1, name.count(".") + 1)})
    sources = "{\n" + "".join(f"    {module.__name__!r}: {module_source(module)!r},\n"
                              for module in manifest.modules) + "}"
    return (f"# A program shipped by orchestrate: the modules {', '.join(names)}.\n"
            f"_SOURCES = {sources}\n_PACKAGES = {tuple(packages)!r}\n"
            + _BOOTSTRAP + "\n" + entry.rstrip() + "\n")


#: The longest single command-line argument Linux takes (``MAX_ARG_STRLEN``: 32 pages of 4 KiB).
MAX_ARGUMENT = 32 * 4096


def compact(text: str) -> str:
    """A short program that unpacks ``text`` (a program's source) and runs it: what goes on a
    command line (``python -S -c``) when the text itself may outgrow :data:`MAX_ARGUMENT`.
    Tracebacks still name the shipped modules (each is compiled under its own name)."""
    packed = base64.b85encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")
    return ("import base64, zlib\n"
            f"exec(compile(zlib.decompress(base64.b85decode({packed!r})), "
            "'<orchestrate program>', 'exec'))\n")
