"""Every user mistake: exit status 2, one message per problem naming the field, no traceback.

``broken/*.yaml`` is a corpus of wrong inventories and jobs. Each file says on its first line
what the error must name (``# expect: FIELD``); more ``# expect:`` lines add fragments the
message must contain, and ``# args:`` gives the command (default: ``validate``). The file's path
is the last argument.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.support.corecli import CORE, Result, cli, cli_process

pytestmark = pytest.mark.unit

BROKEN = sorted((CORE / "broken").glob("*.yaml"))
#: Cases whose check asks this machine (a local job's GPUs: ``nvidia-smi``) say so by a
#: ``# tier: process`` line, so the rest stay in the unit tier.
CASES = [pytest.param(path, marks=pytest.mark.process)
         if "\n# tier: process" in path.read_text(encoding="utf-8") else path for path in BROKEN]


def _header(path: Path) -> tuple[list[str], list[str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# expect: "), f"{path.name}: first line must be '# expect: ...'"
    expect = [line.removeprefix("# expect: ") for line in lines if line.startswith("# expect: ")]
    args = next((line.removeprefix("# args: ") for line in lines if line.startswith("# args: ")),
                "validate")
    return expect, shlex.split(args)


def assert_user_error(result: Result) -> list[str]:
    """Exit 2, nothing on stdout but ok-lines, no traceback; returns the error lines."""
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "Traceback" not in result.out
    errors = [line for line in result.err.splitlines() if line.startswith("error: ")]
    assert errors, result.err
    assert len(errors) == len(set(errors)), f"a problem reported twice:\n{result.err}"
    return errors


def test_the_corpus_is_big_enough() -> None:
    assert len(BROKEN) >= 25


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in BROKEN])
def test_broken_file_gives_a_clear_user_error(path: Path) -> None:
    expect, args = _header(path)
    result = cli(*args, path)
    errors = assert_user_error(result)
    text = result.err
    for fragment in expect:
        assert fragment in text, f"{path.name}: {fragment!r} not in:\n{text}"
    # the field (first expectation) is named in an error line, not only in a hint
    assert any(expect[0] in line for line in errors), text


@pytest.mark.process
def test_the_corpus_through_a_real_process() -> None:
    """One ``python -m orchestrate validate`` over every validate case: all reported, exit 2."""
    cases = [p for p in BROKEN if _header(p)[1] == ["validate"]]
    result = cli_process("validate", *cases)
    assert_user_error(result)
    for path in cases:
        assert str(path) in result.err or path.name in result.err, path.name


@pytest.mark.parametrize(
    ("override", "field", "fragment"),
    [
        ("resources.nodes=two", "resources.nodes", "valid integer"),
        ("resources.nodes=0", "resources.nodes", "greater than or equal to 1"),
        ("resources.gpus_per_node=some", "resources.gpus_per_node", "valid integer or 'all'"),
        ("distributed.master_port=80", "distributed.master_port", "between 1024 and 65535"),
        ("backend=k8s", "backend", "'local', 'slurm' or 'ssh'"),
        ("resources.nodez=2", "resources.nodez", "unknown field"),
        ("nodes=2", "nodes", "unknown field"),
        ("resources", "--set", "expected FIELD=VALUE"),
        ("env.RANK=3", "env", "set per rank"),
        ("command=[]", "command", "the command is empty"),
        ("slurm.signal=USR1", "slurm.signal", "NCCL uses SIGUSR1"),
    ],
)
def test_set_overrides_are_type_checked(override: str, field: str, fragment: str) -> None:
    job = CORE / "jobs" / "uneven-ssh.yaml"
    result = cli("plan", job, "--set", override)
    errors = assert_user_error(result)
    assert any(field in line and fragment in line for line in errors), result.err


def test_a_misplaced_set_override_gets_a_did_you_mean() -> None:
    result = cli("plan", CORE / "jobs" / "uneven-ssh.yaml", "--set", "nodes=2")
    assert "did you mean 'resources.nodes'?" in result.err


def test_set_overrides_apply_with_yaml_types() -> None:
    import json

    job = CORE / "jobs" / "uneven-ssh.yaml"
    result = cli("plan", "--json", job, "--set", "resources.nodes=1", "--set",
                 "resources.gpus_per_node=2", "--set", "env.NCCL_DEBUG=INFO", "--set",
                 "distributed.master_port=29999", "--set", "command=[python, other.py, --x]")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["world_size"] == 2 and plan["master_port"] == 29999
    assert plan["env"]["NCCL_DEBUG"] == "INFO"
    assert plan["command"] == ["python", "other.py", "--x"]


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text(
        "name: demo\nbackend: ssh\ncommand: [x]\n"
        "resources:\n  nodes: 0\n  gpus_per_nod: 2\ndistributed:\n  master_port: 1\n"
    )
    errors = assert_user_error(cli("validate", bad))
    assert len(errors) == 3
    assert any("job.yaml:5: resources.nodes" in e for e in errors)
    assert any("job.yaml:6: resources.gpus_per_nod: unknown key" in e for e in errors)
    assert any("job.yaml:8: distributed.master_port" in e for e in errors)


def test_a_missing_file_is_a_user_error(tmp_path: Path) -> None:
    for args in (["validate"], ["plan"], ["render"], ["inventory", "show"]):
        result = cli(*args, tmp_path / "nope.yaml")
        errors = assert_user_error(result)
        assert "nope.yaml: file not found" in errors[0]


def test_a_template_mistake_is_a_user_error(tmp_path: Path) -> None:
    """StrictUndefined: a misspelled variable in a job's own template is refused, not blank."""
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "node.sh.j2").write_text("#!/usr/bin/env bash\necho {{ plan.job_nmae|q }}\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: demo\ninventory: {CORE / 'inventories' / 'cpu.yaml'}\nbackend: ssh\n"
        "command: [x]\ntemplates_dir: templates\n"
    )
    errors = assert_user_error(cli("render", job))
    assert "template error" in errors[0] and "job_nmae" in errors[0]


def test_busy_s_is_checked_against_the_stall_bound(tmp_path: Path) -> None:
    """``distributed.busy_s`` (how long busy ranks hold a stall off, docs/hangs.md): a number,
    above 0, never below ``stall_s``; each mistake at its file:line."""
    bad = tmp_path / "job.yaml"
    head = "name: demo\nbackend: ssh\ncommand: [x]\ndistributed:\n"
    bad.write_text(head + "  stall_s: 60\n  busy_s: 30\n")
    errors = assert_user_error(cli("validate", bad))
    assert any("job.yaml:6: distributed.busy_s" in e and "at least distributed.stall_s (60 s)"
               in e and "(got 30)" in e for e in errors), errors
    for value, fragment in (("0", "greater than 0"), ("ten", "valid number")):
        bad.write_text(head + f"  busy_s: {value}\n")
        errors = assert_user_error(cli("validate", bad))
        assert any("job.yaml:5: distributed.busy_s" in e and fragment in e for e in errors), (
            errors)
    bad.write_text(head + "  stall_s: 60\n  busy_s: 600\n")
    assert "distributed.busy_s" not in cli("validate", bad).err
