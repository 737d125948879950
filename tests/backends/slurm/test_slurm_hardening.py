"""What a hostile run of the Slurm path broke, each reproduced on the real test cluster and now
held: a secret kept on the controller's disk (slurmctld saves a batch job's environment in its
state directory), and rank output without a bound (now stored once, cut into LINE_MAX pieces,
capped by logs.max_mb_per_rank).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from orchestrate.hostside.outputlog import LINE_MAX
from tests.support.clusters import BRING_UP
from tests.support.output import merged_text
from tests.support.slurmcli import OrchestrateCli, submitted_id
from tests.support.slurmcluster import BOTH_RELEASES

pytestmark = pytest.mark.slurm


def _files_holding(needle: bytes, *roots: Path) -> list[str]:
    """Every file under ``roots`` whose bytes hold ``needle`` (what ``grep -r`` would list)."""
    found = []
    for root in roots:
        for path in (p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            try:
                if needle in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue
    return found


@BOTH_RELEASES
@pytest.mark.timeout(BRING_UP + 120)
def test_a_secret_reaches_every_rank_and_no_file_of_the_cluster(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    value = f"tok-{uuid.uuid4().hex}"
    check = f'test "$(printf %s "$MY_TOKEN" | rev)" = {value[::-1]} && echo ok-$RANK'
    job = ocli.write("secret.yaml", f"""\
        name: secret
        inventory: inventory.yaml
        backend: slurm
        resources: {{nodes: 2, gpus_per_node: 1, time: "5"}}
        secret_env: [MY_TOKEN]
        command: [bash, -c, '{check}']
        """)
    env = dict(ocli.env, MY_TOKEN=value)
    proc = ocli.run("submit", str(job), "--follow", timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok-0" in proc.stdout and "ok-1" in proc.stdout, proc.stdout
    job_id = submitted_id(proc)
    status = ocli.status(job_id)
    run_dir = Path(status["run_dir"])
    # slurmctld's state (StateSaveLocation: each job's script and environment), every slurmd's
    # spool, the daemons' logs; and the job's own run directory, once it has ended.
    state = ocli.cluster.state_dir
    held = _files_holding(value.encode(), state / "ctld", state / "spool", state / "log",
                          run_dir, ocli.home)
    assert held == [], f"the secret is on disk in {held}"
    # It never went through sbatch's environment (the controller keeps that for the job).
    kept = list((state / "ctld").glob(f"hash.*/job.{status['external_id']}/environment"))
    assert kept, "the controller keeps the job's environment there (the test's premise)"
    assert b"MY_TOKEN=" not in kept[0].read_bytes()


CHATTY = ("import sys\n"
          "sys.stdout.write('z' * (3 << 20))\n"  # 3 MB in one line, no newline yet
          "sys.stdout.write('\\nthe end\\n')\n")


@pytest.mark.timeout(BRING_UP + 120)
def test_a_ranks_output_is_stored_once_cut_into_pieces_and_capped(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    ocli.write("chatty.py", CHATTY)
    job = ocli.write("chatty.yaml", """\
        name: chatty
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 1, time: "5"}
        command: [python, chatty.py]
        logs: {max_mb_per_rank: 2}
        """)
    job_id = ocli.submit(job)
    status = ocli.wait(job_id, {"COMPLETED", "FAILED"}, timeout=120)
    run_dir = Path(status["run_dir"])
    text = merged_text(run_dir)
    assert status["state"] == "COMPLETED", text[-2000:]
    for rank in (0, 1):
        # The rank's file keeps its first 2 MB (the rank ran on: it exited 0).
        assert (run_dir / "logs" / f"rank-{rank}.log").stat().st_size == 2 << 20
        assert f"[orchestrate] rank {rank} reached logs.max_mb_per_rank (2 MB)" in text
        pieces = [line for line in text.splitlines() if line.startswith("[") and
                  f":{rank}] z" in line]
        assert len(pieces) == (2 << 20) // LINE_MAX, len(pieces)
    assert "the end" not in text
    # One copy: no merged log beside the rank files, only the small index.
    assert not (run_dir / "output.log").exists()
    assert (run_dir / "output.idx").stat().st_size < 4096
