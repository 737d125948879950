"""Backends are told apart by their traits, never by their names, outside ``backends/``.

The 2026-12-04 review (C3) added a backend ``dummy`` that was the local backend under another
name: planning refused it ("needs an inventory") and, given one, ran its ranks under another
Python. Here that experiment is a test: a renamed backend with the local backend's traits plans
exactly as ``local`` does. And a static pass keeps a name comparison from coming back.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import get_args

import pytest

from orchestrate.core.spec import backendtraits
from orchestrate.core.spec.backendtraits import TRAITS, traits
from orchestrate.core.spec.inventory import load_inventory_spec
from orchestrate.core.spec.job import Backend, JobSpec
from orchestrate.run.prepare import load_spec, plan_job
from tests.support.corecli import REPO, TEST_INVENTORIES

pytestmark = pytest.mark.unit

PACKAGE = REPO / "orchestrate"
NAMES = frozenset(get_args(Backend))


def test_every_backend_has_traits_and_a_module() -> None:
    from orchestrate.backends import _MODULES

    assert set(TRAITS) == NAMES == set(_MODULES)


def _job(backend: str) -> JobSpec:
    job = JobSpec.model_validate({
        "name": "renamed", "command": ["python", "-m", "mypkg.train"],
        "framework": "lightning-fabric", "resources": {"nodes": 1},
    })
    # A name the Backend literal does not know: as a new backend before its literal is added.
    return job.model_copy(update={"backend": backend})


def test_a_renamed_local_backend_plans_as_local_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No inventory needed (this machine), the submitting interpreter, torchrun's variables:
    every decision, the whole plan, is the local backend's."""
    this_machine, _ = load_inventory_spec(TEST_INVENTORIES / "localhost-cpu.yaml")
    monkeypatch.setattr("orchestrate.probe.machine.local_inventory_spec", lambda: this_machine)
    monkeypatch.setitem(TRAITS, "dummy", TRAITS["local"])
    plans = {}
    for name in ("local", "dummy"):
        loaded = load_spec(_job(name), tmp_path)
        assert loaded.inventory_source == ""  # planned on this machine, no inventory asked
        plans[name] = plan_job(loaded, "renamed-1").plan
    local, dummy = plans["local"], plans["dummy"]
    assert dummy.nodes[0].python == local.nodes[0].python == sys.executable
    assert dummy.env["TORCHELASTIC_RUN_ID"] == "renamed-1"
    assert any("TorchElasticEnvironment" in n for n in dummy.notes), dummy.notes
    assert {**dummy.to_json(), "backend": "local"} == local.to_json()


def test_traits_not_names_decide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same renamed backend with Slurm's traits: an inventory is needed."""
    from orchestrate.core.errors import UserError

    monkeypatch.setitem(TRAITS, "dummy", traits("slurm"))
    with pytest.raises(UserError, match="the dummy backend needs an inventory"):
        load_spec(_job("dummy"), tmp_path)


def _is_backend(node: ast.expr) -> bool:
    """``backend`` or ``<anything>.backend``: a job's, plan's or record's backend name."""
    return (isinstance(node, ast.Name) and node.id == "backend") or (
        isinstance(node, ast.Attribute) and node.attr == "backend")


def _names_in(node: ast.expr) -> set[str]:
    """The backend names a comparison's operand spells: a string, or a tuple/list/set of them."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES}


def _name_branches(path: Path, root: Path = REPO) -> list[str]:
    """Every comparison of a backend with a backend's name in ``path``, and every table
    looked up by a backend's name, as ``file:line: code``."""
    where = path.relative_to(root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_is_backend, operands)) and set().union(*map(_names_in, operands)):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and _is_backend(node.slice):
            found.append(f"{where}:{node.lineno}: a table by backend name: "
                         f"{ast.unparse(node)}")
    return found


def test_no_code_outside_the_backends_branches_on_a_backend_name() -> None:
    """``job.backend == "slurm"``, ``plan.backend in ("local", "ssh")``, ``RUNTIMES[job.backend]``:
    each is a decision a new backend would silently miss. Ask ``traits(backend)`` instead (the
    one table by name is :data:`orchestrate.core.spec.backendtraits.TRAITS`)."""
    table = Path(backendtraits.__file__).resolve()
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             if PACKAGE / "backends" not in path.parents and path.resolve() != table
             for hit in _name_branches(path)]
    assert not found, "\n".join(found)


def test_the_static_pass_sees_a_name_branch(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('if job.backend == "slurm":\n    pass\n'
                       'if backend in ("local", "ssh"):\n    pass\n'
                       'if shape.backend == "nccl":\n    pass\n'  # torch's, not ours
                       'allowed = RUNTIMES[job.backend]\n')
    hits = [line.split(": ", 1)[1] for line in _name_branches(planted, tmp_path)]
    assert hits == ["job.backend == 'slurm'", "backend in ('local', 'ssh')",
                    "a table by backend name: RUNTIMES[job.backend]"]

