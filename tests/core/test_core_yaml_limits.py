"""Hostile YAML: files that cost minutes and gigabytes to read are refused before any walk.

A 421-byte job whose aliases expand to millions of values (an "alias bomb"), an alias that
refers to itself, a thousand nested ``[``, a file of ten megabytes: each is a user error
(``file:line: problem`` and exit 2) found in well under a second, while anchors used for small
reuse load as before.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.spec.loader import ALIAS_LIMIT, MAX_DEPTH, MAX_FILE_BYTES, parse_yaml
from tests.support.corecli import CORE, cli, cli_process

pytestmark = pytest.mark.unit

INVENTORY = CORE / "inventories" / "localhost-cpu.yaml"


def _bomb(levels: int = 7, fan: int = 9) -> str:
    """The issue's file: each level a list of ``fan`` aliases of the level before it."""
    lines = ["name: bomb", "command: [python, train.py]",
             "a0: &a0 [" + ", ".join(["x"] * fan) + "]"]
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * fan) + "]")
    return "\n".join(lines) + "\n"


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.mark.timing
@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", [["validate"], ["plan"], ["render"], ["submit", "--dry-run"]])
def test_an_alias_bomb_is_refused_in_well_under_a_second(tmp_path: Path,
                                                          command: list[str]) -> None:
    job = tmp_path / "bomb.yaml"
    job.write_text(_bomb())
    assert len(job.read_bytes()) < 500
    # CPU time, not wall time: the claim is that the reader does not do the expansion's work,
    # and a busy machine stretches the wall clock of any work (tests/support/busy.py).
    started = time.process_time()
    result = cli(*command, job)
    took = time.process_time() - started
    assert result.code == 2, result.err
    assert took < 1.0, f"{took:.2f} s of CPU"
    errors = _errors(result.err)
    assert len(errors) == 1, result.err
    # Where (the first alias past the bound), what, and the bound itself.
    assert f"{job}:" in errors[0] and "aliases" in errors[0]
    assert f"{ALIAS_LIMIT:,}" in result.err


@pytest.mark.process
@pytest.mark.timeout(30)
def test_an_alias_bomb_through_a_real_process_is_exit_2_without_a_traceback(
        tmp_path: Path) -> None:
    job = tmp_path / "bomb.yaml"
    job.write_text(_bomb(levels=8))  # 467 bytes: ~25 GB before
    result = cli_process("validate", job, timeout=20)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err and "aliases" in result.err


@pytest.mark.timing
def test_an_alias_bomb_in_an_inventory_and_in_set_is_refused(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    bomb_keys = _bomb().split("\n", 2)[2]  # the a0..a6 lines, without name and command
    inventory.write_text(INVENTORY.read_text() + bomb_keys)
    result = cli("inventory", "show", inventory)
    assert result.code == 2 and "aliases" in result.err, result.err
    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\ninventory: {INVENTORY}\ncommand: [python, train.py]\n")
    nested = "&b0 [" + ", ".join(["x"] * 9) + "]"
    for level in range(1, 7):
        nested = f"&b{level} [{nested}, " + ", ".join([f"*b{level - 1}"] * 8) + "]"
    started = time.process_time()  # CPU time: the work, not the machine's load
    result = cli("plan", job, "--set", f"env.X={nested}")
    assert time.process_time() - started < 1.0
    assert result.code == 2 and "--set" in result.err and "aliases" in result.err, result.err


def test_anchors_for_small_reuse_still_load(tmp_path: Path) -> None:
    (tmp_path / "mypkg.py").write_text("def model():\n    pass\n\n\ndef data():\n    pass\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: reuse\ninventory: {INVENTORY}\n"
        "train:\n  model: mypkg:model\n  model_args: &sizes {hidden: 64, layers: 2}\n"
        "  dataset: mypkg:data\n  dataset_args: *sizes\n"
    )
    result = cli("plan", "--json", job)
    assert result.code == 0, result.err
    train = json.loads(result.out)["train_config"]
    assert train["model_args"] == train["dataset_args"] == {"hidden": 64, "layers": 2}
    data, _ = parse_yaml("a: &x {k: [1, 2, 3]}\nb: *x\nc: {<<: *x, extra: 1}\n", "t.yaml")
    assert data == {"a": {"k": [1, 2, 3]}, "b": {"k": [1, 2, 3]},
                    "c": {"k": [1, 2, 3], "extra": 1}}


def test_aliases_may_add_up_to_the_bound_and_not_one_more() -> None:
    """The bound counts the values aliases add (each alias adds its whole subtree)."""
    hundred = "[" + ", ".join(["x"] * 99) + "]"  # a list of 99 scalars is 100 values
    uses = ALIAS_LIMIT // 100
    at_bound = f"a: &a {hundred}\nb: [" + ", ".join(["*a"] * uses) + "]\n"
    data, _ = parse_yaml(at_bound, "ok.yaml")
    assert len(data["b"]) == uses
    over = at_bound.replace("b: [", "b: [*a, ")
    with pytest.raises(UserError) as caught:
        parse_yaml(over, "over.yaml")
    assert "over.yaml" in str(caught.value) and "aliases" in str(caught.value)


def test_an_alias_that_refers_to_itself_is_refused() -> None:
    for text in ("a: &a [1, *a]\n", "a: &a {k: *a}\n"):
        with pytest.raises(UserError) as caught:
            parse_yaml(text, "loop.yaml")
        problem = caught.value.problems[0]
        assert problem.source == "loop.yaml" and problem.line == 1
        assert "refers to itself" in problem.message


@pytest.mark.process
@pytest.mark.timeout(30)
def test_deep_nesting_is_a_user_error_with_its_line(tmp_path: Path) -> None:
    job = tmp_path / "deep.yaml"
    job.write_text("name: deep\ncommand: [python, train.py]\n"
                   "env:\n  X: " + "[" * 1000 + "]" * 1000 + "\n")
    result = cli_process("validate", job, timeout=20)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err and "RecursionError" not in result.err
    errors = _errors(result.err)
    assert len(errors) == 1 and f"{job}:4:" in errors[0], result.err
    assert f"{MAX_DEPTH}" in errors[0]
    # As deep as the bound still loads (then the job's own checks speak).
    data, _ = parse_yaml("x: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "\n", "ok")
    assert isinstance(data["x"], list)


@pytest.mark.timeout(30)
def test_a_huge_file_is_refused_by_its_size(tmp_path: Path) -> None:
    job = tmp_path / "huge.yaml"
    job.write_text("name: huge\ncommand: [python, '" + "a" * 10_000_000 + "']\n")
    started = time.monotonic()
    result = cli("validate", job)
    assert time.monotonic() - started < 1.0
    assert result.code == 2, result.err
    errors = _errors(result.err)
    assert len(errors) == 1 and str(job) in errors[0], result.err
    assert f"{MAX_FILE_BYTES // 2**20} MiB" in result.err
    with pytest.raises(UserError):
        parse_yaml("x: '" + "a" * MAX_FILE_BYTES + "'\n", "text")
