"""The layers hold: each package loads only the packages below it, and the core stays pure.

The packages are stacked, bottom up (docs/architecture.md):
``hostside < core (spec < plan < render) < diagnosis < report | probe < train < run < backends
< doctor < cli`` (the report reads the diagnosis' records and the plan; the metrics record that
the trainer writes and the report reads sits in core). Each one is imported whole (every module
in it) in a fresh interpreter, and the ``orchestrate`` packages that then sit in
``sys.modules`` must all be below it: an import that runs back up, at module level or through
another module, fails here. The core also loads no process, database, SSH, Slurm or torch code,
and the host side nothing but the standard library.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # fresh interpreters

#: Bottom up; every package may load the ones before it in its own chain.
BELOW: dict[str, set[str]] = {
    "hostside": set(),
    "core.spec": {"core"},
    "core.plan": {"core", "core.spec"},
    "core.render": {"core", "core.spec", "core.plan", "hostside"},
    "diagnosis": {"core", "hostside"},
    "report": {"core", "core.spec", "core.plan", "hostside", "diagnosis"},
    "probe": {"core", "core.spec", "hostside"},
}
CORE = {"core", "core.spec", "core.plan", "core.render"}
BELOW["core"] = CORE | {"hostside"}
BELOW["train"] = BELOW["core"] | {"diagnosis"}
BELOW["run"] = BELOW["train"] | {"report", "probe", "train"}
BELOW["backends"] = BELOW["run"] | {"run"}
BELOW["doctor"] = BELOW["backends"] | {"backends"}
BELOW["cli"] = BELOW["doctor"] | {"doctor"}

#: What the pure core must never load, and what the host side may load beyond the stdlib (none).
FORBIDDEN_IN_CORE = ("subprocess", "sqlite3", "fabric", "paramiko", "submitit", "torch")
THIRD_PARTY = ("pydantic", "yaml", "jinja2", "click", "rich", "fabric", "submitit", "torch")

_PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module("orchestrate." + sys.argv[1])
names = [package.__name__] + [
    info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if not info.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
def layer(module):
    parts = module.split(".")[1:]
    sub = ".".join(parts[:2])
    return sub if parts[0] == "core" and hasattr(sys.modules["orchestrate." + sub], "__path__") \
        else parts[0]
loaded = sorted({layer(m) for m in sys.modules if m.startswith("orchestrate.")})
print(json.dumps({"layers": loaded, "modules": sorted(sys.modules)}))
"""


def _load(package: str) -> tuple[set[str], set[str]]:
    done = subprocess.run([sys.executable, "-c", _PROBE, package], capture_output=True,
                          text=True, check=True)
    found = json.loads(done.stdout)
    return set(found["layers"]), set(found["modules"])


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_package_loads_only_the_layers_below_it(package: str) -> None:
    layers, _ = _load(package)
    allowed = BELOW[package] | {package, "version", package.split(".")[0]}
    assert layers - allowed == set(), f"{package} reaches up into {sorted(layers - allowed)}"


def test_importing_the_core_loads_nothing_impure() -> None:
    _, modules = _load("core")
    assert sorted(m for m in FORBIDDEN_IN_CORE if m in modules) == []


def test_the_host_side_loads_only_the_standard_library() -> None:
    _, modules = _load("hostside")
    assert sorted(m for m in THIRD_PARTY if m in modules) == []


def test_the_check_can_fail() -> None:
    """The checks above can fail: the backends do load what the core must not, and the CLI
    sits above every other layer."""
    layers, modules = _load("backends")
    assert "submitit" in modules and "sqlite3" in modules
    assert "run" in layers and "run" not in BELOW["core"]
