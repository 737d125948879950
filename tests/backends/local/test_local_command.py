"""Your own program gets the same care as ``train:`` (issue #33): a ``command:`` job that
reports its steps with the one documented line (``from orchestrate_steps import report``) gets
the loss curve, the straggler split and the NaN stop; a program that takes its rank as
arguments (pytorch/examples' imagenet: ``--dist-url --world-size --rank``) runs under
``per_node`` with the shell line docs/launchers.md gives.

Real local 2-rank jobs (gloo on CPU) started by ``orchestrate submit``; the program is
tests/backends/programs/reported_train.py (it imports nothing of orchestrate).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.localcli import Cli

pytestmark = [pytest.mark.process, pytest.mark.torch]

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
PROGRAM = PROGRAMS / "reported_train.py"
DOCS = Path(__file__).resolve().parents[3] / "docs" / "launchers.md"


def _until_done(cli: Cli, job: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = cli.status(job)
        if status["state"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def _submit(cli: Cli, name: str, body: str) -> dict[str, Any]:
    path = cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        distributed: {{backend: gloo}}
        restart: {{max: 0}}
        {body}
        """)
    job = cli.id(name)
    cli.run("submit", str(path), "--job-id", job, check=True)
    return _until_done(cli, job, 120)


def _records(run_dir: Path, name: str) -> list[dict[str, Any]]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(180)
def test_a_command_job_that_reports_steps_gets_curves_pace_and_report(cli: Cli) -> None:
    out = cli.work / "out-steps"
    status = _submit(cli, "steps", f"""
        env: {{OUT: '{out}', STEPS: '30'}}
        command: [python3, '{PROGRAM}']""")
    assert status["state"] == "COMPLETED", status
    run_dir = Path(status["run_dir"])
    metrics = _records(run_dir, "metrics.jsonl")
    assert metrics[0]["kind"] == "start" and metrics[0]["world_size"] == 2, metrics[0]
    steps = [m for m in metrics if m["kind"] == "step"]
    assert [m["step"] for m in steps] == list(range(1, 31))
    assert all(isinstance(m["train_loss"], float) for m in steps)
    for rank in (0, 1):  # every rank's own timing windows: the straggler split's input
        windows = _records(run_dir, f"timing/rank-{rank}.jsonl")
        assert sum(w["steps"] for w in windows) == 29, windows  # the first call starts the clock
        assert all(w["backward_s"] > 0 and w["wall_s"] >= w["backward_s"] for w in windows)
    report = cli.run("report", cli.id("steps"), check=True)
    html = (run_dir / "report.html").read_text()
    assert 'id="loss"' in html, report.stdout  # the loss chart
    assert "Per-rank time per step" in html


@pytest.mark.timeout(180)
def test_a_command_job_that_reports_a_nan_loss_is_stopped_naming_the_rank(cli: Cli) -> None:
    out = cli.work / "out-nan"
    status = _submit(cli, "nan", f"""
        env: {{OUT: '{out}', STEPS: '400', NAN_AT: '6', NAN_RANK: '1'}}
        command: [python3, '{PROGRAM}']""")
    assert status["state"] == "FAILED", status
    assert status["reason"].startswith("rank 1 on "), status["reason"]  # as for train: jobs
    said = "\n".join(status["failure"]["last_lines"])
    assert "rank 1: the loss is not finite (nan) at step 6; training stopped" in said, said
    assert not list(out.glob("rank-*.json"))  # stopped long before its 400 steps
    steps = [m for m in _records(Path(status["run_dir"]), "metrics.jsonl") if m["kind"] == "step"]
    assert steps and steps[-1]["step"] <= 7, steps[-1]  # rank 0's curve ends at the stop


@pytest.mark.timeout(180)
def test_the_imagenet_mapping_in_the_docs_runs_a_program_taking_its_rank_as_arguments(
        cli: Cli) -> None:
    """The docs' line, as written there, under ``per_node``: the program spawns a worker per
    GPU of its node (``--multiprocessing-distributed``) and numbers them from its arguments."""
    found = re.search(r"^\s*command: (\[sh, -c, 'exec python main\.py [^\n]*\])$",
                      DOCS.read_text(), re.M)
    assert found is not None, "docs/launchers.md lost the imagenet mapping"
    command = found.group(1).replace("python main.py", f"python3 {PROGRAM}")
    out = cli.work / "out-args"
    status = _submit(cli, "args", f"""
        launcher: per_node
        env: {{OUT: '{out}', STEPS: '5'}}
        command: {command}""")
    assert status["state"] == "COMPLETED", status
    worlds = {p.name: json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(worlds) == ["rank-0.json", "rank-1.json"], worlds
    assert {(w["world_size"], w["told"]) for w in worlds.values()} == {(2, "args")}


@pytest.mark.timeout(120)
def test_bash_c_sees_the_inventorys_python_though_bashrc_puts_another_first(
        cli: Cli, tmp_path: Path) -> None:
    """bash reads ~/.bashrc when it believes sshd started it (SSH_CLIENT set, level below 2):
    here a ~/.bashrc that puts a bad python first. The rank's ``bash -c`` still finds the
    inventory's (this interpreter's folder, which the launch script puts first)."""
    home = tmp_path / "login"
    bad = home / "bad-bin"
    bad.mkdir(parents=True)
    (bad / "python3").write_text("#!/bin/sh\necho bad python >&2\nexit 3\n")
    (bad / "python3").chmod(0o755)
    (home / ".bashrc").write_text(f'export PATH="{bad}:$PATH"\necho bashrc read >&2\n')
    cli.env.update(HOME=str(home), SSH_CLIENT="198.18.0.9 40000 22")
    cli.env.pop("SHLVL", None)
    out = cli.work / "out-bash"
    out.mkdir()
    status = _submit(cli, "bashc", f"""
        env: {{OUT: '{out}'}}
        command: [bash, -c, 'command -v python3 > "$OUT/rank-$RANK.txt"; python3 -c pass']""")
    assert status["state"] == "COMPLETED", status
    found = {p.read_text().strip() for p in out.glob("rank-*.txt")}
    assert len(found) == 1 and str(bad) not in found.pop(), found


SHELL_TRAINER = """#!/bin/sh
# A trainer that is not Python: one JSON line per step into $ORCHESTRATE_STEP_FILE.
i=1
while [ "$i" -le 2000 ]; do
  loss=0.5
  if [ "$RANK" = "$NAN_RANK" ] && [ "$i" -ge 4 ]; then loss='"nan"'; fi
  echo "{\\"step\\": $i, \\"loss\\": $loss, \\"samples\\": 8}" >> "$ORCHESTRATE_STEP_FILE"
  i=$((i + 1))
  sleep 0.05
done
"""


@pytest.mark.timeout(180)
def test_a_shell_trainer_reports_through_the_step_file_and_is_stopped_on_nan(cli: Cli) -> None:
    """docs/launchers.md's step file: rank 0's curve comes from a shell program's lines, and
    rank 1's NaN stops the job naming rank 1 with the trainer's sentence, long before its end."""
    program = cli.work / "trainer.sh"
    program.write_text(SHELL_TRAINER)
    program.chmod(0o755)
    status = _submit(cli, "shellsteps", f"""
        env: {{NAN_RANK: '1'}}
        command: [python3, -m, orchestrate_steps, --, '{program}']""")
    assert status["state"] == "FAILED", status
    assert status["reason"].startswith("rank 1 on "), status["reason"]
    said = "\n".join(status["failure"]["last_lines"])
    assert "rank 1: the loss is not finite (nan) at step 4; training stopped" in said, said
    steps = [m for m in _records(Path(status["run_dir"]), "metrics.jsonl") if m["kind"] == "step"]
    assert steps and steps[0]["step"] == 1 and steps[-1]["step"] < 1000, steps[-1:]
