"""The sidecar folder every Python rank loads: a short ``sitecustomize.py`` and
``_orchestrate_rank/``, a private package of copies of orchestrate's stdlib-only modules.

The launch scripts put ``RUN_DIR/sidecar`` first on ``PYTHONPATH`` (templates/node.sh.j2,
sbatch.sh.j2), so Python runs its ``sitecustomize.py`` at start-up, before the rank's program,
with no change to it. That entry imports the sidecar from ``_orchestrate_rank/`` beside it:
the modules :data:`SIDECAR` names (the run-dir
names, the diag records, the timeout bound, the flight recorder, the sidecar and its
activation, the step reporter), each under its last name, with their imports of one another
pointed at the private package. So the rank side and the launcher side share one text of
every name and record, and a rank that imports the user's installed orchestrate (the built-in
trainer does) never gets these copies instead: nothing here is called ``orchestrate``, and no
import hook is needed.

One public module sits beside them, ``orchestrate_steps``: the one line a ``command:``
program needs to report its steps (:mod:`orchestrate.diagnosis.stepreport`), and, run as
``python -m orchestrate_steps -- PROGRAM``, the relay of a program that is not Python
(:mod:`orchestrate.diagnosis.steprelay`).

A carried module may import only the standard library and the other carried modules:
:func:`folder` fails at once on any other ``orchestrate`` import (the tests build it).
"""

from __future__ import annotations

import re
from types import ModuleType

import orchestrate.core.layout
import orchestrate.diagnosis.activation
import orchestrate.diagnosis.diagfiles
import orchestrate.diagnosis.flightrecorder
import orchestrate.diagnosis.joinwatch
import orchestrate.diagnosis.kernelstate
import orchestrate.diagnosis.sidecar
import orchestrate.diagnosis.steprelay
import orchestrate.diagnosis.stepreport
import orchestrate.diagnosis.threadstate
import orchestrate.diagnosis.workers
import orchestrate.hostside.childrun
import orchestrate.hostside.cpubind
import orchestrate.hostside.timeouts
from orchestrate.hostside.shipping import Manifest, module_source

#: Every rank's sidecar: the modules of ``sidecar/_orchestrate_rank/``, copied as files under
#: their last names (:func:`folder`), not bundled into one program.
SIDECAR = Manifest("sidecar", (
    orchestrate.core.layout, orchestrate.hostside.timeouts, orchestrate.hostside.cpubind,
    orchestrate.diagnosis.kernelstate,
    orchestrate.diagnosis.diagfiles, orchestrate.diagnosis.threadstate,
    orchestrate.diagnosis.workers, orchestrate.diagnosis.flightrecorder,
    orchestrate.diagnosis.joinwatch, orchestrate.diagnosis.activation,
    orchestrate.diagnosis.sidecar, orchestrate.diagnosis.stepreport,
    orchestrate.hostside.childrun, orchestrate.diagnosis.steprelay))

#: The private package inside the sidecar folder.
PACKAGE = "_orchestrate_rank"

#: ``sitecustomize.py``: what Python runs at start-up in every process of a rank.
ENTRY = f'''"""orchestrate's rank sidecar (docs/hangs.md): heartbeats, and stacks on request,
for the launcher's stall watch. Python loads this file at start-up because the launch script
put this folder first on PYTHONPATH; {PACKAGE}/ beside it holds private copies of
orchestrate's modules (orchestrate/diagnosis/rankpackage.py).
"""

from {PACKAGE}.activation import run_as_sitecustomize

run_as_sitecustomize(__file__)
'''

_INIT = '''"""Private copies of orchestrate's stdlib-only modules for the rank sidecar (see
../sitecustomize.py); not the orchestrate package, which the rank may import as well."""
'''

#: The one public module of the sidecar folder: what a ``command:`` program imports to report
#: its steps (``from orchestrate_steps import report``; docs/launchers.md).
STEPS_MODULE = "orchestrate_steps"

_STEPS = f'''"""Report your program's steps to orchestrate: ``report(step, loss, samples=n)`` on
every rank, every step (docs/launchers.md); loss curves, the NaN stop and the straggler split.
A program that is not Python: ``python -m orchestrate_steps -- PROGRAM [ARG...]``, writing a
JSON line per step to the file ``$ORCHESTRATE_STEP_FILE`` names.
orchestrate's launch script put this folder on PYTHONPATH; the code is {PACKAGE}/stepreport.py.
"""

from {PACKAGE}.stepreport import report

__all__ = ["report"]

if __name__ == "__main__":  # python -m orchestrate_steps -- PROGRAM: the file protocol
    import sys

    from {PACKAGE}.steprelay import main

    sys.exit(main(sys.argv[1:]))
'''

_IMPORT = re.compile(r"^(\s*from\s+)(orchestrate(?:\.\w+)+)(\s+import\b)", re.M)
_ANY_IMPORT = re.compile(r"^\s*(?:from|import)\s+orchestrate\b", re.M)


def _private(name: str) -> str:
    return f"{PACKAGE}.{name.rsplit('.', 1)[1]}"


def carried(module: ModuleType, manifest: Manifest) -> str:
    """``module``'s source with its imports of ``manifest``'s modules pointed at
    :data:`PACKAGE`; raises ValueError when it imports any other orchestrate module."""
    def point(found: re.Match[str]) -> str:
        if found.group(2) not in manifest.names:
            raise ValueError(f"{module.__name__} imports {found.group(2)}, which the sidecar "
                             "folder does not carry (rankpackage.SIDECAR)")
        return found.group(1) + _private(found.group(2)) + found.group(3)

    text = _IMPORT.sub(point, module_source(module))
    stray = _ANY_IMPORT.search(text)
    if stray is not None:
        raise ValueError(f"{module.__name__} imports orchestrate in a way the sidecar folder "
                         f"cannot carry: {stray.group(0).strip()!r}")
    return text


def folder() -> dict[str, str]:
    """The sidecar folder's files, by path inside it: ``sitecustomize.py``,
    ``_orchestrate_rank/__init__.py``, one ``_orchestrate_rank/<name>.py`` per module, and
    ``orchestrate_steps.py``, the step reporter's public name."""
    names = [_private(m).split(".")[1] for m in SIDECAR.names]
    if len(set(names)) != len(names):
        raise ValueError(f"two carried modules share a name: {SIDECAR.names}")
    files = {"sitecustomize.py": ENTRY, f"{PACKAGE}/__init__.py": _INIT,
             f"{STEPS_MODULE}.py": _STEPS}
    for module, name in zip(SIDECAR.modules, names, strict=True):
        files[f"{PACKAGE}/{name}.py"] = carried(module, SIDECAR)
    return files
