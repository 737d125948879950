"""The pure core stays pure: importing it loads no process, database, SSH, Slurm or torch code.

The planner, the renderer and the specs take values and return values; only backends, the CLI
and the training entrypoint touch the world. A ruff rule bans direct imports in a few modules;
this test pins the whole seam down, transitive imports included, in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

#: The core: parsing, planning, rendering, and the records that cross process boundaries.
CORE = (
    "orchestrate.schema", "orchestrate.errors", "orchestrate.exits", "orchestrate.loader",
    "orchestrate.hostlist", "orchestrate.inventory", "orchestrate.job", "orchestrate.memory",
    "orchestrate.ports", "orchestrate.placement", "orchestrate.ranks", "orchestrate.rankenv",
    "orchestrate.plan", "orchestrate.allocation", "orchestrate.render", "orchestrate.layout",
    "orchestrate.outcome", "orchestrate.shipping", "orchestrate.train.config",
)
FORBIDDEN = ("subprocess", "sqlite3", "fabric", "paramiko", "submitit", "torch")


def test_importing_the_core_loads_nothing_impure() -> None:
    program = (
        "import importlib, json, sys\n"
        f"for name in {CORE!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {FORBIDDEN!r} if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True)
    assert json.loads(done.stdout) == []


def test_the_impure_modules_would_be_seen() -> None:
    """The check above can fail: importing a backend does load what the core must not."""
    program = (
        "import json, sys\n"
        "import orchestrate.backends.local\n"
        f"print(json.dumps(sorted(m for m in {FORBIDDEN!r} if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True)
    assert "subprocess" in json.loads(done.stdout)
