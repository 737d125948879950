"""Strict numbers and booleans in every field of the job, inventory and train section.

YAML hands pydantic ``true`` where a count was meant (``cpus: true`` became 1), ``1e999`` where
a rate was meant (``inf``, printed as ``Infinity`` by ``--json``, which is not JSON), and
``yes`` or ``1`` where a switch was meant. Every numeric field refuses true/false and inf/nan,
every switch wants true or false, and what ``plan --json`` and ``inventory show --json`` print
is always JSON. The fields are found by walking the models, so a new field is covered too.
"""

from __future__ import annotations

import copy
import itertools
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from orchestrate.core.spec.inventory import InventorySpec
from orchestrate.core.spec.job import JobSpec
from tests.support.corecli import CORE, cli

pytestmark = pytest.mark.unit

TRAIN_JOB = CORE / "jobs" / "train-slurm.yaml"
JOB = {"name": "j", "command": ["python", "t.py"],
       "train": {"model": "m:f", "dataset": "d:f"}}  # one entrypoint is dropped per field
INVENTORY = {"name": "inv",
             "nodes": [{"name": "a", "gpus": [{"model": "A100", "memory_gb": 80, "count": 2}],
                        "numa": [{"node": 0, "cpus": "0-3", "gpus": [0, 1]}],
                        "gpu_islands": [{"gpus": [0, 1]}]}]}


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...],
                                                                                  type]]:
    """(path, scalar type) of every int, float and bool field, lists' items included (path
    ends in ``0``); dicts of free values (env, model_args) have no fixed type and are left out."""
    out: list[tuple[tuple[str, ...], type]] = []
    for name, field in model.model_fields.items():
        key = (*prefix, field.alias or name)
        out += _leaves_of(field.annotation, key)
    return out


def _leaves_of(annotation: Any, key: tuple[str, ...]) -> list[tuple[tuple[str, ...], type]]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaves_of(typing.get_args(annotation)[0], key)
    if origin in (typing.Union, types.UnionType):
        per_arg = [_leaves_of(arg, key) for arg in typing.get_args(annotation)]
        models = [leaves for arg, leaves in zip(typing.get_args(annotation), per_arg, strict=True)
                  if isinstance(arg, type) and issubclass(arg, BaseModel)]
        scalars = [leaves for leaves in per_arg if leaves]
        # A model (TrainSpec | None): its fields; else one scalar type (int | 'all': the int).
        return models[0] if models else (scalars[0] if scalars else [])
    if origin in (list, tuple):
        return [leaf for arg in typing.get_args(annotation)[:1]
                for leaf in _leaves_of(arg, (*key, "0"))]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _leaves(annotation, key)
    if annotation in (int, float, bool):
        return [(key, annotation)]
    return []


def _document(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    if "train" in doc and "command" in doc:
        doc.pop("command" if path[0] == "train" else "train")
    node: Any = doc
    for part, after in itertools.pairwise(path):
        child = node[int(part)] if isinstance(node, list) else node.get(part)
        if child is None:
            child = [] if after.isdigit() else {}
            node[part] = child
        node = child
    last = path[-1]
    if isinstance(node, list):
        node[:] = [value]
    else:
        node[last] = value
    return doc


def _refused(model: type[BaseModel], doc: dict[str, Any], path: tuple[str, ...]) -> str:
    """The error message at ``path`` (the test fails if the value was accepted)."""
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            loc = tuple(str(p) for p in err["loc"])
            if loc[: len(path)] == path:
                return str(err["msg"])
        raise AssertionError(f"{'.'.join(path)}: refused elsewhere: {exc}") from None
    raise AssertionError(f"{'.'.join(path)}: accepted {doc}")


CASES = [(model, base, path, kind) for model, base in ((JobSpec, JOB), (InventorySpec, INVENTORY))
         for path, kind in _leaves(model)]


def test_the_walk_finds_the_fields_the_issue_names() -> None:
    paths = {".".join(path) for _, _, path, _ in CASES}
    assert {"nodes.0.cpus", "nodes.0.network.gbps", "train.optimizer.momentum",
            "nodes.0.ssh.accept_unknown_host_keys", "restart.backoff_s.0",
            "resources.gpus_per_node", "nodes.0.gpus.0.indices.0"} <= paths
    assert len(paths) > 50


@pytest.mark.parametrize(("model", "base", "path", "kind"), CASES,
                         ids=[".".join(c[2]) for c in CASES])
def test_no_boolean_where_a_number_is_wanted_and_no_loose_boolean(
        model: type[BaseModel], base: dict[str, Any], path: tuple[str, ...], kind: type) -> None:
    if kind is bool:
        for loose in ("yes", "on", 1, 0):
            assert "boolean" in _refused(model, _document(base, path, loose), path)
    else:
        for boolean in (True, False):
            assert "true/false" in _refused(model, _document(base, path, boolean), path)
        if kind is float:
            for endless in (float("inf"), float("-inf"), float("nan"), "1e999"):
                assert "finite" in _refused(model, _document(base, path, endless), path)


@pytest.mark.parametrize("text", ["cpus: true", "network: {gbps: 1e999}", "slots: .inf",
                                  "ssh: {accept_unknown_host_keys: yes}"])
def test_the_issues_inventory_values_are_file_line_errors(tmp_path: Path, text: str) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"name: inv\nnodes:\n  - name: a\n    slots: 2\n    {text}\n"
                         .replace("    slots: 2\n    slots: .inf", "    slots: .inf"))
    result = cli("inventory", "show", "--json", inventory)
    assert result.code == 2, result.out
    assert f"{inventory}:" in result.err and "(got " in result.err
    assert "Infinity" not in result.out


@pytest.mark.parametrize("override", [
    "train.optimizer.momentum=false", "train.model_args.scale=.inf",
    "train.dataset_args.x=[1, .nan]", "train.model_params=1e999", "resources.nodes=true",
    "train.model_params=1e308", "train.activation_memory_gb=1e308",
])
def test_the_issues_job_values_are_refused(override: str) -> None:
    result = cli("plan", "--json", TRAIN_JOB, "--set", override)
    assert result.code == 2, result.out
    field = override.partition("=")[0]
    assert f"error: --set: {field.rsplit('.', 1)[0] if 'args' in field else field}" in result.err


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("value", ["1e308", "1.0e308", "-1e308", "1e-308", "0", "7"])
def test_plan_json_is_always_json(value: str) -> None:
    """Any float field set to the extremes a YAML file can hold: a refusal (2), or JSON."""
    floats = [p for _, base, p, kind in CASES if base is JOB and kind is float]
    for path in floats:
        result = cli("plan", "--json", TRAIN_JOB, "--set", f"{'.'.join(path).removesuffix('.0')}"
                     f"={'[' + value + ']' if path[-1] == '0' else value}")
        assert result.code in (0, 2), (path, result.err)
        if result.code == 0:
            _strict_json(result.out)
    for job in sorted((CORE / "jobs").glob("*.yaml")):
        result = cli("plan", "--json", job)
        assert result.code == 0, result.err
        _strict_json(result.out)


@pytest.mark.parametrize("where", ["set", "file"])
@pytest.mark.parametrize("value", ["!0", "!!python/object:os.system x"])
def test_a_yaml_tag_safe_yaml_cannot_build_is_a_user_error(tmp_path: Path, where: str,
                                                           value: str) -> None:
    """Found by the fuzz test: ``--set resources.nodes=!0`` ended in a YAML traceback."""
    job = tmp_path / "job.yaml"
    text = f"name: x\ncommand: [python, t.py]\ninventory: {CORE / 'inventories' / 'uniform.yaml'}\n"
    if where == "file":
        text += f"env:\n  A: {value}\n"
    job.write_text(text)
    args = ["plan", job] + (["--set", f"resources.nodes={value}"] if where == "set" else [])
    result = cli(*args)
    assert result.code == 2, result.out
    assert "Traceback" not in result.err and "error: " in result.err
    if where == "file":
        assert f"{job}:5:" in result.err and "tag" in result.err
