"""Whatever a file holds, the CLI answers with exit 0 or a user error (2), never a traceback.

Valid inventories and jobs get one value replaced at a random place by a random YAML value
(wrong type, null, nested, huge, empty), or get a random --set override, and go through the
real CLI in-process: an exception escaping ``main`` fails the test.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.corecli import CORE, INVENTORIES, cli, write_yaml

pytestmark = pytest.mark.unit

LAB = yaml.safe_load((INVENTORIES / "lab.yaml").read_text())
JOB = {
    "name": "fuzz",
    "inventory": "inventory.yaml",
    "backend": "ssh",
    "resources": {"nodes": 1, "gpus_per_node": 2, "gpu_model": "RTX-A6000"},
    "command": ["python", "train.py"],
    "env": {"A": "1"},
    "distributed": {"master_port": 29500},
    "slurm": {"partition": "p", "extra_args": ["--exclusive"]},
    "workdir": "/srv/w",
    "run_root": "/srv/r",
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
    st.text(max_size=12), st.sampled_from(["all", "auto", "nccl", "gpu[01-03]", "", "-1"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _paths(value, (*prefix, i))
    return out


def _replace(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    data = copy.deepcopy(data)
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


def _check(result_code: int) -> None:
    assert result_code in (0, 2)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data(), values)
def test_a_mangled_inventory_is_a_user_error(tmp_path: Path, data: st.DataObject,
                                              value: Any) -> None:
    path = data.draw(st.sampled_from(_paths(LAB)))
    inventory = write_yaml(tmp_path / "inventory.yaml", _replace(LAB, path, value))
    result = cli("inventory", "show", "--json", inventory)
    _check(result.code)
    assert "Traceback" not in result.err


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data(), values)
def test_a_mangled_job_is_a_user_error(tmp_path: Path, data: st.DataObject, value: Any) -> None:
    write_yaml(tmp_path / "inventory.yaml", LAB)
    path = data.draw(st.sampled_from(_paths(JOB)))
    job = write_yaml(tmp_path / "job.yaml", _replace(JOB, path, value))
    result = cli("plan", "--json", job)
    _check(result.code)
    if result.code == 2:
        assert result.err.startswith("error: ")


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    st.sampled_from(["resources.nodes", "resources.gpus_per_node", "env.X", "command", "name",
                     "distributed", "slurm.extra_args", "resources", "env", "a.b.c", "",
                     "resources.node_names", "train.model", "backend"]),
    st.text(max_size=15),
)
def test_any_set_override_is_a_user_error_or_works(field: str, raw: str) -> None:
    result = cli("plan", "--json", CORE / "jobs" / "uneven-ssh.yaml", "--set", f"{field}={raw}")
    _check(result.code)
    assert "Traceback" not in result.err


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    for text in ("[1, 2]", "just a string", "42", "~", "", "---\n...\n", "a: b: c"):
        path = tmp_path / "x.yaml"
        path.write_text(text)
        for args in (["validate"], ["plan"], ["inventory", "show"]):
            result = cli(*args, path)
            _check(result.code)
