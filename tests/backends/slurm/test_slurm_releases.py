"""The Slurm parsers on the output of every release orchestrate claims (20.11 to 25.11), the
version gate for newer options, and the batch script's shells kept safe from bash's
command-substitution parse while a trapped signal comes (the requeue ``trap`` error).

Recorded outputs are in ``releases/`` (SOURCE.md says where each comes from): a RUNNING GPU job
whose name and comment hold `` JobState=COMPLETED`` and other keys, and a drained GPU node whose
reason and comment do the same, in the multi-line and ``--oneliner`` forms.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrate.backends.slurm.backend import SlurmBackend
from orchestrate.backends.slurm.ctl import (
    SlurmClient,
    job_gpus,
    job_state_name,
    parse_show_job,
    parse_show_node,
    tres_gpus,
)
from orchestrate.backends.slurm.probe import SlurmNode
from orchestrate.backends.slurm.version import (
    SlurmVersion,
    cluster_version,
    expedite,
    forget_versions,
    parse_version,
    requeue_options,
)
from orchestrate.backends.slurm.view import view_of
from orchestrate.core.plan.plan import make_plan
from orchestrate.run.store import JobRecord, RankRecord
from tests.support import plans

pytestmark = pytest.mark.unit

RELEASES_DIR = Path(__file__).parent / "releases"
RELEASES = ("20.11", "22.05", "23.02", "23.11", "24.05", "24.11", "25.05", "25.11")
GOLDEN = Path(__file__).resolve().parents[2] / "core" / "golden"


@pytest.mark.parametrize("form", ["", "-oneliner"])
@pytest.mark.parametrize("release", RELEASES)
def test_show_job_of_every_release_keeps_the_state_against_injected_keys(
        release: str, form: str) -> None:
    (job,) = parse_show_job((RELEASES_DIR / f"job-{release}{form}.txt").read_text())
    assert (job["JobId"], job["JobState"], job["Reason"]) == ("4242", "RUNNING", "None")
    assert (job["Restarts"], job["ExitCode"], job["NodeList"]) == ("2", "0:0", "g[1-2]")
    assert job["JobName"] == "evil JobState=COMPLETED Reason=None x"
    assert job["Command"] == "/srv/runs/my run/job.sbatch"
    assert job["UserId"] == "alice(1000)"
    assert job_gpus(job) == 8  # AllocTRES from 23.02, TRES before; TresPerJob says gres/gpu:8
    assert ("AllocTRES" in job) == (release >= "23.02")
    assert (job.get("ExpeditedRequeue") == "Yes") == (release == "25.11")
    if not form:  # the free text is whole only where lines bound it
        assert job["Comment"] == "c JobState=COMPLETED Reason=None ExitCode=0:0 Restarts=0 " \
                                 "NodeList=x"
        assert job["StdOut"] == "/srv/runs/my run/slurm-4242.out"


@pytest.mark.parametrize("form", ["", "-oneliner"])
@pytest.mark.parametrize("release", RELEASES)
def test_show_node_of_every_release_keeps_state_gres_and_alloc_tres(
        release: str, form: str) -> None:
    (record,) = parse_show_node((RELEASES_DIR / f"node-{release}{form}.txt").read_text())
    node = SlurmNode.from_record(record)
    assert (node.name, node.state, node.gres_type) == ("g1", "MIXED+DRAIN", "a100")
    assert (node.cpus, node.memory_mb, node.partitions) == (64, 500000, ("gpu",))
    assert tres_gpus(record["AllocTRES"]) == 4 and tres_gpus(record["CfgTRES"]) == 4
    assert record["OS"].startswith("Linux 6.1.0-18-amd64 #1 SMP")
    if not form:
        assert node.reason == "xid 79 State=IDLE GPU fell off the bus [root@2026-12-01T10:30:00]"
        assert record["Comment"] == "rack 4 State=DOWN"


@pytest.mark.parametrize("release", ["22.05.8", "24.11.5"])
def test_captured_held_job_with_keys_in_name_and_comment_stays_pending(release: str) -> None:
    """Recorded on real clusters (22.05.8: tests/clusters/slurm.sh; 24.11.5: slurm-root.sh
    smoke): ``sbatch --hold -J 'evil JobState=COMPLETED x' --comment='c JobState=COMPLETED
    Reason=None ExitCode=0:0'``."""
    folder = RELEASES_DIR / f"captured-{release}"
    for name in ("job-held.txt", "job-held-oneliner.txt"):
        (job,) = parse_show_job((folder / name).read_text())
        assert (job["JobState"], job["Reason"], job["ExitCode"]) == ("PENDING", "JobHeldUser",
                                                                     "0:0")
        assert job["JobName"] == "evil JobState=COMPLETED x"
        assert job_gpus(job) == 0 and job_state_name(job) == "PENDING"
    (job,) = parse_show_job((folder / "job-held.txt").read_text())
    assert job["Comment"] == "c JobState=COMPLETED Reason=None ExitCode=0:0"


@pytest.mark.parametrize("form", ["", "-oneliner"])
def test_captured_24_11_jobs_and_node(form: str) -> None:
    folder = RELEASES_DIR / "captured-24.11.5"
    assert parse_version((folder / "version.txt").read_text()) == SlurmVersion(24, 11, 5)
    (ok,) = parse_show_job((folder / f"job-ok{form}.txt").read_text())
    (failing,) = parse_show_job((folder / f"job-failing{form}.txt").read_text())
    assert (ok["JobState"], ok["ExitCode"], ok["BatchHost"]) == ("COMPLETED", "0:0", "n1")
    assert (failing["JobState"], failing["Reason"], failing["ExitCode"]) == (
        "FAILED", "NonZeroExitCode", "3:0")
    assert ok["AllocTRES"] == "cpu=1,node=1,billing=1" and "TRES" not in ok
    (record,) = parse_show_node((folder / f"node{form}.txt").read_text())
    node = SlurmNode.from_record(record)
    assert (node.name, node.state, node.cpus, node.gres) == ("n1", "IDLE", 2, "")
    assert record["Version"] == "24.11.5" and record["AllocTRES"] == ""
    lines = (folder / "squeue.txt").read_text().splitlines()
    assert lines[-1] == "3|PENDING|JobHeldUser|evil JobState=COMPLETED x"


def test_a_value_holding_a_record_start_does_not_make_a_second_record() -> None:
    text = ("JobId=7 JobName=a JobId=8 b UserId=u(1) GroupId=g(1) MCS_label=N/A Priority=1 "
            "Nice=0 Account=a QOS=n JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
            "Requeue=0 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 Comment=x JobId=9\n")
    (job,) = parse_show_job(text)
    assert (job["JobId"], job["JobName"], job["JobState"]) == ("7", "a JobId=8 b", "FAILED")


@pytest.mark.parametrize(("named", "base"), [
    ("PENDING", "PENDING"), ("RUNNING", "RUNNING"), ("REQUEUED", "PENDING"),
    ("REQUEUED_CRON", "PENDING"), ("REQUEUE_FED", "PENDING"), ("REQUEUE_HOLD", "PENDING"),
    ("EXPEDITING", "PENDING"), ("SPECIAL_EXIT", "PENDING"), ("RESV_DEL_HOLD", "PENDING"),
    ("COMPLETING", "COMPLETING"), ("OUT_OF_MEMORY", "OUT_OF_MEMORY"), ("DEADLINE", "DEADLINE"),
])
def test_state_names_of_every_release(named: str, base: str) -> None:
    assert job_state_name({"JobState": named}) == base
    assert job_state_name({}) == "UNKNOWN"


def test_gpus_from_tres_lists() -> None:
    assert tres_gpus("cpu=16,mem=400G,node=2,billing=16,gres/gpu=8,gres/gpu:a100=8") == 8
    assert tres_gpus("cpu=4,gres/gpu:a100=2,gres/gpu:v100=1") == 3
    assert tres_gpus("cpu=4,mem=4000M") == 0 and tres_gpus("") == 0
    assert job_gpus({"TresPerNode": "N/A", "AllocTRES": "cpu=2,gres/gpu=2"}) == 2


@pytest.mark.parametrize(("text", "version"), [
    ("slurm 20.11.9\n", SlurmVersion(20, 11, 9)), ("slurm-wlm 22.05.8\n", SlurmVersion(22, 5, 8)),
    ("slurm 24.11.5\n", SlurmVersion(24, 11, 5)), ("slurm 25.11.0-0rc1\n", SlurmVersion(25, 11)),
    ("sbatch: command not found", None),
])
def test_versions_and_the_options_each_takes(text: str, version: SlurmVersion | None) -> None:
    assert parse_version(text) == version
    assert expedite(version) == (version is not None and version >= SlurmVersion(25, 11))
    assert requeue_options(version, requeue=False) == ()
    assert requeue_options(version, requeue=True) == (
        ("--requeue=expedite",) if expedite(version) else ())


@pytest.mark.process
def test_the_version_is_asked_once_per_cluster(tmp_path: Path) -> None:
    """A fake sbatch on PATH counts its calls: two lookups for one SLURM_CONF run it once."""
    calls = tmp_path / "calls"
    (tmp_path / "sbatch").write_text(f"#!/bin/sh\necho x >>{calls}\necho 'slurm 25.11.1'\n")
    (tmp_path / "sbatch").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "a.conf")}
    forget_versions()
    try:
        first = cluster_version(SlurmClient(env))
        again = cluster_version(SlurmClient(env))
        other = cluster_version(SlurmClient({**env, "SLURM_CONF": str(tmp_path / "b.conf")}))
    finally:
        forget_versions()
    assert first == again == other == SlurmVersion(25, 11, 1)
    assert calls.read_text().count("x") == 2


# ---- the requeue `trap` error ------------------------------------------------------------------

_SUBSTITUTION = re.compile(r"\$\(|<\(")


def _code(line: str) -> str:
    return line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""


def test_no_command_substitution_where_a_trapped_signal_can_come() -> None:
    """bash 5.2 parses ``$(...)``/``<(...)`` as it runs them; a trap run in the middle breaks
    the parse ("trap: line 2: unexpected EOF while looking for matching `)'"). The rank shell
    traps the stop signals from its start, the batch shell from its srun on: neither may use
    one (an arithmetic ``$((...))`` is not one)."""
    scripts = sorted(GOLDEN.glob("*slurm*.render.txt"))
    assert scripts
    for path in scripts:
        lines = path.read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if "== --task ]]" in line)
        end = next(i for i in range(start, len(lines)) if lines[i] == "fi")
        batch = next(i for i, line in enumerate(lines) if line.startswith("trap 'STOPPING="))
        called = [i for i, line in enumerate(lines)  # the batch shell's functions run late too
                  if re.match(r"orchestrate_(now|note|event|end)\(\) \{", line)]
        bodies = [range(i, next(j for j in range(i, len(lines)) if lines[j].endswith("}")) + 1)
                  for i in called]
        assert len(bodies) == 4
        for i in [*range(start, end), *range(batch, len(lines)), *(i for b in bodies for i in b)]:
            code = _code(lines[i]).replace("$((", "")
            assert not _SUBSTITUTION.search(code), f"{path.name}:{i + 1}: {lines[i]}"


@pytest.mark.process
def test_the_rank_shells_exit_record_survives_a_flood_of_trapped_signals(tmp_path: Path) -> None:
    """The rank shell's own lines (the ``orchestrate_now`` of a rendered script, its exit
    record) under thousands of SIGTERMs, as at a requeue: no parse error, every record whole.
    With ``$(orchestrate_now)`` this printed the trap error within seconds here."""
    text = (GOLDEN / "slurm-full.render.txt").read_text()
    function = re.search(r"^orchestrate_now\(\) \{.*?^\}$", text, re.S | re.M)
    assert function is not None
    record = re.search(r"^  ended=0 .*?rank-\$slot\"$", text, re.S | re.M)
    assert record is not None
    script = tmp_path / "rank.sh"
    script.write_text(
        "trap : TERM INT HUP USR2\n" + function.group(0) + "\nORCHESTRATE_EXIT_DIR=$1\n"
        "status=75 slot=0\ntouch \"$1/ready\"\n"
        "for ((i = 0; i < 4000; i++)); do\n" + record.group(0) + "\ndone\n")
    proc = subprocess.Popen(["bash", str(script), str(tmp_path)], stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = 0
    while proc.poll() is None and sent < 20000:
        proc.send_signal(signal.SIGTERM)
        sent += 1
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err == ""
    assert sent > 100
    words = (tmp_path / "rank-0").read_text().split()
    assert words[0] == "75" and len(words[1]) == 16 and words[1].isdigit()


def test_a_batch_script_that_died_before_its_step_is_failed_with_slurms_exit_code(
        tmp_path: Path) -> None:
    """Slurm says FAILED 3:0 and the run directory holds no run at all (the batch script died
    before its first line that records one): the reason gives Slurm's ExitCode."""
    spec = plans.job(backend="slurm", command=["python", "x.py"])
    plan = make_plan(spec, plans.inventory({"name": "n1", "slots": 2}), job_id="f-1",
                     run_dir=str(tmp_path), workdir=str(tmp_path))
    job = JobRecord(id="f-1", name="j", backend="slurm", state="RUNNING", run_dir=str(tmp_path),
                    plan=plan, submitted_at=1.0, external_id="77",
                    ranks=[RankRecord(rank=r, node="n1") for r in range(2)])
    record = {"JobId": "77", "JobState": "FAILED", "Reason": "NonZeroExitCode",
              "ExitCode": "3:0", "Restarts": "0"}
    view = view_of(job, record, [], SlurmClient())
    assert view.state == "FAILED"
    assert "batch script failed with Slurm ExitCode=3:0 before starting the ranks" in view.reason


@pytest.mark.process
@pytest.mark.parametrize(("release", "on", "options"), [
    ("25.11.1", ["requeue", "node_lost"], ("--requeue=expedite",)),
    ("25.11.1", ["requeue"], ()),  # submitted --no-requeue: stays so
    ("24.11.5", ["requeue", "node_lost"], ()),  # sbatch 24.11 would refuse "=expedite"
])
def test_submit_asks_for_an_expedited_requeue_only_where_the_release_has_it(
        tmp_path: Path, release: str, on: list[str], options: tuple[str, ...]) -> None:
    (tmp_path / "sbatch").write_text(f"#!/bin/sh\necho 'slurm {release}'\n")
    (tmp_path / "sbatch").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "s.conf")}
    spec = plans.job(backend="slurm", command=["python", "x.py"], restart={"max": 2, "on": on})
    plan = make_plan(spec, plans.inventory({"name": "n1", "slots": 2}), job_id="e-1",
                     run_dir=str(tmp_path), workdir=str(tmp_path))
    forget_versions()
    try:
        assert SlurmBackend(SlurmClient(env)).release_options(plan) == options
    finally:
        forget_versions()
