"""The Slurm backend's pure parts, without a cluster: parsers on recorded Slurm output, the
allocation a plan asks for, the rendered script (shellcheck), and the log merger on real files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrate.backends import rendered
from orchestrate.backends.slurm.allocation import slurm_layout
from orchestrate.backends.slurm.ctl import (
    parse_exit_code,
    parse_job_id,
    parse_node_states,
    parse_sacct,
    parse_show_job,
)
from orchestrate.backends.slurm.record import job_failure, rank_exits
from orchestrate.backends.slurm.script import monitor_program
from orchestrate.backends.slurm.view import with_workers
from orchestrate.core.errors import UserError
from orchestrate.core.layout import rank_log, slurm_exit_dir
from orchestrate.core.plan.outcome import Exit, RankEnd
from orchestrate.core.spec.job import time_limit_seconds
from orchestrate.run.prepare import prepare
from tests.support import plans
from tests.support.output import merged_text

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]

# Recorded on the test cluster (Slurm 22.05.8): `scontrol show job --oneliner` of a failed job.
ONELINER = (
    "JobId=19955689 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901710 Nice=0 Account=(null) QOS=(null) JobState=FAILED "
    "Reason=NonZeroExitCode Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=3:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-30T00:05:05 Partition=debug AllocNode:Sid=localhost:30232 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 "
    "TRES=cpu=1,node=1,billing=1 Command=/srv/my runs/job.sbatch WorkDir=/work/main "
    "StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= \n"
)
# `scontrol show job` (multi-line) of a heterogeneous job: one record per component.
HETEROGENEOUS = """\
JobId=19955641 HetJobId=19955641 HetJobOffset=0 JobName=h.sbatch
   HetJobIdSet=19955641-19955642
   JobState=PENDING Reason=BeginTime Dependency=(null)
   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0
   NodeList=

JobId=19955642 HetJobId=19955641 HetJobOffset=1 JobName=h.sbatch
   HetJobIdSet=19955641-19955642
   JobState=PENDING Reason=BeginTime Dependency=(null)
   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0
"""


def test_show_job_oneliner_keeps_values_with_spaces() -> None:
    (job,) = parse_show_job(ONELINER)
    assert job["JobId"] == "19955689"
    assert (job["JobState"], job["Reason"], job["ExitCode"]) == ("FAILED", "NonZeroExitCode",
                                                                 "3:0")
    assert job["Command"] == "/srv/my runs/job.sbatch"
    assert job["TRES"] == "cpu=1,node=1,billing=1"
    assert job["AllocNode:Sid"] == "localhost:30232"
    assert job["Power"] == ""
    assert (job["Restarts"], job["Requeue"], job["NodeList"]) == ("0", "1", "n1")


def test_show_job_heterogeneous_gives_one_record_per_component() -> None:
    records = parse_show_job(HETEROGENEOUS)
    assert [r["JobId"] for r in records] == ["19955641", "19955642"]
    assert records[0]["HetJobId"] == "19955641" and records[1]["HetJobOffset"] == "1"
    assert records[0]["JobState"] == "PENDING" and records[0]["Restarts"] == "1"
    assert records[0]["NodeList"] == ""


def test_small_parsers() -> None:
    assert parse_job_id("19955689\n") == "19955689"
    assert parse_job_id("42;cluster-a\n") == "42"
    with pytest.raises(ValueError):
        parse_job_id("sbatch: error: nope\n")
    assert parse_exit_code("3:0") == (3, 0)
    assert parse_exit_code("0:15") == (0, 15)
    assert parse_sacct("CANCELLED by 0|0:15\n") == ("CANCELLED", "0:15")
    assert parse_sacct("") is None
    assert parse_node_states("n1 allocated\nn3 down*\n") == {"n1": "allocated", "n3": "down*"}


def test_time_limits_in_every_slurm_format() -> None:
    assert time_limit_seconds("10") == 600
    assert time_limit_seconds("10:30") == 630
    assert time_limit_seconds("01:00:00") == 3600
    assert time_limit_seconds("2-00") == 2 * 86400
    assert time_limit_seconds("1-02:03") == 86400 + 2 * 3600 + 3 * 60
    assert time_limit_seconds("1-00:00:05") == 86405


# ---- the allocation and the script ------------------------------------------------------


def _job(tmp_path: Path, name: str, body: str, inventory: str) -> Path:
    (tmp_path / "inv.yaml").write_text(textwrap.dedent(inventory))
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\ninventory: inv.yaml\nbackend: slurm\n"
                    + textwrap.dedent(body))
    return path


CPU_INVENTORY = """\
    name: cpus
    defaults: {slurm: {partition: debug}, network: {interface: eth0}}
    nodes:
      - {name: n1, slots: 2}
      - {name: n2, slots: 3}
      - {name: n3, slots: 3}
    """
GPU_INVENTORY = """\
    name: gpus
    defaults: {slurm: {partition: gpu, gres_type: a100}}
    nodes:
      - {name: "g[1-2]", gpus: [{model: A100, memory_gb: 80, count: 4}]}
      - {name: g3, gpus: [{model: A100, memory_gb: 80, count: 2}]}
    """


def _options(path: Path, *overrides: str) -> list[str]:
    plan = prepare(path, overrides, job_id="t-1").plan
    return [name if value is None else f"{name}={value}"
            for name, value in slurm_layout(plan).options]


def test_allocation_uniform_uneven_and_gpus(tmp_path: Path) -> None:
    uniform = _job(tmp_path, "u", """\
        resources: {nodes: 2, gpus_per_node: 2, time: "30", cpus_per_task: 2, mem_gb: 1.5}
        command: [python, x.py]
        slurm: {account: acct, qos: high, extra_args: ["--exclusive", "--comment=a b"]}
        """, CPU_INVENTORY)
    assert _options(uniform) == [
        "--job-name=u", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2", "--mem=1536M",
        "--time=30", "--partition=debug", "--account=acct", "--qos=high", "--signal=USR2@120",
        "--requeue", "--open-mode=append", "--exclusive", "--comment=a b",
    ]
    uneven = _job(tmp_path, "v", """\
        resources: {nodes: 2, gpus_per_node: all, node_names: [n3, n1]}
        command: [python, x.py]
        restart: {on: [requeue]}
        """, CPU_INVENTORY)
    options = _options(uneven)
    assert options[:4] == ["--job-name=v", "--nodes=2", "--ntasks=5", "--ntasks-per-node=3"]
    assert "--nodelist=n[3,1]" in options and "--no-requeue" in options
    layout = slurm_layout(prepare(uneven, (), job_id="t-2").plan)
    assert layout.pinned_hosts == ("n3", "n1")
    assert [(r.rank, r.local_rank, r.node_index) for r in layout.ranks] == [
        (0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 0, 1), (4, 1, 1)]

    gpus = _job(tmp_path, "g", "resources: {nodes: 2}\ncommand: [python, x.py]\n", GPU_INVENTORY)
    assert "--gres=gpu:a100:4" in _options(gpus)
    assert "CUDA_VISIBLE_DEVICES" not in slurm_layout(prepare(gpus, (), job_id="t").plan
                                                      ).nodes[0].env
    mixed = _job(tmp_path, "m", "resources: {nodes: 3}\ncommand: [python, x.py]\n",
                 GPU_INVENTORY)
    assert {"--gpus-per-task=a100:1", "--gpu-bind=none"} <= set(_options(mixed))


def test_allocation_refuses_what_slurm_cannot_do(tmp_path: Path) -> None:
    job = _job(tmp_path, "r", """\
        resources: {nodes: 1, gpus_per_node: 1, time: "2"}
        command: [python, x.py]
        """, CPU_INVENTORY)
    with pytest.raises(UserError, match=r"signal_seconds_before.*at once"):
        _options(job)  # the default 120 s before a 2-minute limit
    assert "--signal=USR2@60" in _options(job, "slurm.signal_seconds_before=60")
    with pytest.raises(UserError, match="one sbatch option"):
        _options(job, "slurm.signal_seconds_before=60", "slurm.extra_args=[--constraint, a100]")
    with pytest.raises(UserError, match="USR1"):
        _options(job, "slurm.signal=USR1")
    two = textwrap.dedent(CPU_INVENTORY).replace(
        "- {name: n3, slots: 3}", "- {name: n3, slots: 3, slurm: {partition: other}}")
    mixed = _job(tmp_path, "p", """\
        resources: {nodes: 2, gpus_per_node: 2, node_names: [n2, n3]}
        command: [python, x.py]
        """, two)
    with pytest.raises(UserError, match="different partitions"):
        _options(mixed)


@pytest.mark.process
@pytest.mark.parametrize("name", ["uniform", "uneven-pinned", "uneven-gpus", "secrets-fixed",
                                  "per-node-uneven", "torchrun-fixed"])
def test_rendered_script_passes_shellcheck(tmp_path: Path, name: str) -> None:
    bodies = {
        "uniform": ("resources: {nodes: 2, gpus_per_node: 2}\ncommand: [python, 'a b.py']\n",
                    CPU_INVENTORY),
        "uneven-pinned": ("resources: {nodes: 2, gpus_per_node: all, node_names: [n3, n1]}\n"
                          "command: [python, x.py]\nrestart: {on: [requeue]}\n",
                          CPU_INVENTORY),
        "uneven-gpus": ("resources: {nodes: 3}\ncommand: [python, x.py]\n", GPU_INVENTORY),
        "per-node-uneven": ("resources: {nodes: 2, gpus_per_node: all, node_names: [n3, n1]}\n"
                            "launcher: per_node\ncommand: [python, spawn.py]\n", CPU_INVENTORY),
        "torchrun-fixed": ("resources: {nodes: 2, gpus_per_node: 2}\nlauncher: torchrun\n"
                           "distributed: {master_port: 29500, master_addr: n2}\n"
                           "command: [python, -m, pkg.train]\n", GPU_INVENTORY),
        "secrets-fixed": ("resources: {nodes: 2, gpus_per_node: 1}\ncommand: [python, x.py]\n"
                          "secret_env: [TOKEN]\n"
                          "distributed: {master_port: 29500, master_addr: n2}\n"
                          "env: {QUOTE: \"it's $HOME\"}\n"
                          "logs: {max_mb_per_rank: 1}\n", CPU_INVENTORY),
    }
    body, inventory = bodies[name]
    files = rendered(prepare(_job(tmp_path, "s", body, inventory), (), job_id="s-1"))
    script = tmp_path / "job.sbatch"
    script.write_text(files["job.sbatch"])
    for check in (["bash", "-n", str(script)], ["shellcheck", str(script)]):
        proc = subprocess.run(check, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    text = files["job.sbatch"]
    assert "#SBATCH --signal=USR2@120" in text and "B:" not in text
    if name == "secrets-fixed":
        assert "MASTER_PORT=29500" in text and "MASTER_ADDR=n2" in text
        assert "export QUOTE='it'\"'\"'s $HOME'" in text
        assert "head -c 1048576" in text  # logs.max_mb_per_rank, in each rank's shell
        assert 'export TOKEN="${SECRET_VALUES[0]}"' in text  # from the 0600 file, for srun
    if name == "torchrun-fixed":  # fixed by the job: the words themselves, not the shell's
        assert "--master-addr=n2 --master-port=29500 " in text


# ---- the log merger ---------------------------------------------------------------------


def _monitor(tmp_path: Path) -> Path:
    """The monitor program exactly as ``render`` ships it beside job.sbatch."""
    path = tmp_path / "monitor.py"
    path.write_text(monitor_program())
    return path


def _start_merger(tmp_path: Path, hosts: list[str]) -> subprocess.Popen[bytes]:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "hosts").write_text("".join(h + "\n" for h in hosts))
    ready = tmp_path / "merger-ready"
    ready.unlink(missing_ok=True)
    merger = subprocess.Popen([sys.executable, "-S", str(_monitor(tmp_path)), "merge",
                               str(tmp_path / "output.idx"),
                               str(tmp_path / "logs"), str(tmp_path / "hosts"),
                               str(tmp_path / "offsets.json"), str(ready)])
    # As job.sbatch does: its SIGTERM handler is in place once it says so (on a busy machine
    # a stop sent before that ended it by the signal, before it indexed anything).
    deadline = time.monotonic() + 60
    while not ready.exists() and merger.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), "the merger never said it was ready"
    return merger


def _stop(merger: subprocess.Popen[bytes]) -> None:
    merger.send_signal(signal.SIGTERM)
    assert merger.wait(timeout=10) == 0


@pytest.mark.process
def test_merger_writes_whole_prefixed_lines_and_resumes_after_a_requeue(tmp_path: Path) -> None:
    rank0, rank1 = tmp_path / "logs" / "rank-0.log", tmp_path / "logs" / "rank-1.log"
    merger = _start_merger(tmp_path, ["n1", "n2"])
    try:
        with open(rank0, "ab", buffering=0) as a, open(rank1, "ab", buffering=0) as b:
            a.write(b"first half of a line ")
            b.write(b"one\ntwo\n")
            time.sleep(0.4)
            a.write(b"and its end\n")
            b.write(("x" * 5000 + "\nünïcode\nno newline at the end").encode())
            time.sleep(0.4)
    finally:
        _stop(merger)
    lines = merged_text(tmp_path).splitlines()
    assert sorted(lines) == sorted([
        "[n1:0] first half of a line and its end", "[n2:1] one", "[n2:1] two",
        "[n2:1] " + "x" * 5000, "[n2:1] ünïcode", "[n2:1] no newline at the end",
    ])
    assert json.loads((tmp_path / "offsets.json").read_text()) == [
        rank0.stat().st_size, rank1.stat().st_size]

    # The next run (a requeue) appends to the same files: only the new lines are merged.
    with open(rank0, "ab") as a:
        a.write(b"after the requeue\n")
    merger = _start_merger(tmp_path, ["n3", "n2"])
    time.sleep(0.4)
    _stop(merger)
    assert merged_text(tmp_path).splitlines()[len(lines):] == [
        "[n3:0] after the requeue"]


# ---- the verdict on a run: first failure and requeue, decided in Python ----------------------


def _record(exit_dir: Path, rank: int, status: int, at_us: int, host: str) -> None:
    exit_dir.mkdir(parents=True, exist_ok=True)
    (exit_dir / f"rank-{rank}").write_text(f"{status} {at_us} {host}\n")


POLICY = {"max": 3, "on": ["requeue", "node_lost"], "backoff_s": [0], "exclude_failed_node": False}


def _decide(tmp_path: Path, restart: int = 0, max_restarts: int = 3,
            *more: str, launcher: str = "ranks", **policy: object) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-S", str(_monitor(tmp_path)), "decide", str(tmp_path / "output.idx"),
         str(tmp_path / "exits"), str(restart),
         json.dumps({**POLICY, "max": max_restarts, **policy}),
         str(tmp_path), str(tmp_path / "marker.json"), "", "0", *more],
        capture_output=True, text=True, check=True,
        env={"PATH": os.environ["PATH"], "ORCHESTRATE_LAUNCHER": launcher})
    verdict, status, _wait, _exclude = done.stdout.split()
    return verdict, int(status)


@pytest.mark.process
def test_the_first_failure_breaks_ties_by_rank_like_every_backend(tmp_path: Path) -> None:
    """Equal timestamps: the lowest rank is named (a shell's glob order would pick rank 10)."""
    for rank in (2, 10):
        _record(tmp_path / "exits", rank, 1, 1_000_000, f"n{rank}")
    _record(tmp_path / "exits", 0, 0, 900_000, "n0")
    assert _decide(tmp_path) == ("FAILED", 1)
    assert "rank 2 on n2 failed with exit code 1" in merged_text(tmp_path)


@pytest.mark.process
def test_the_rank_that_explains_the_failure_is_named_not_the_first_silent_one(
        tmp_path: Path) -> None:
    """Issue #33 item 3, as monitor.py decides it: rank 1 ended 0.4 s first saying nothing."""
    _record(tmp_path / "exits", 1, 1, 1_000_000, "n1")
    _record(tmp_path / "exits", 0, 1, 1_400_000, "n0")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.log").write_text("rank 0: the loss is not finite (NaN)\n")
    (tmp_path / "logs" / "rank-1.log").write_text("")
    assert _decide(tmp_path) == ("FAILED", 1)
    assert "rank 0 on n0 failed with exit code 1" in merged_text(tmp_path)


@pytest.mark.process
def test_a_run_whose_ranks_all_ask_to_resume_is_requeued_until_the_budget(tmp_path: Path) -> None:
    for rank in range(3):
        _record(tmp_path / "exits", rank, 75, 1_000_000 + rank, "n1")
    assert _decide(tmp_path, restart=0) == ("REQUEUE", 75)
    assert _decide(tmp_path, restart=3) == ("FAILED", 75)
    log = merged_text(tmp_path)
    assert "requeuing, restart 1 of at most 3" in log
    assert "the restart budget is spent (3 of restart.max = 3)" in log
    # A rank that died (SIGKILL: 137) among those asking to resume: no requeue, it failed.
    _record(tmp_path / "exits", 1, 137, 999_999, "n2")
    assert _decide(tmp_path) == ("FAILED", 137)
    assert "rank 1 on n2 failed with signal 9 (SIGKILL)" in merged_text(tmp_path)


@pytest.mark.process
def test_a_failed_rank_restarts_in_the_allocation_unless_a_node_is_to_be_avoided(
        tmp_path: Path) -> None:
    """Issue #37: a rank's failure leaves the allocation intact, so the batch script runs a new
    step of the same job (RESTART) instead of `scontrol requeue`; avoiding the failed node
    needs a new allocation (REQUEUE)."""
    _record(tmp_path / "exits", 0, 0, 1_000_000, "n1")
    _record(tmp_path / "exits", 1, 137, 900_000, "n2")
    on = ["requeue", "node_lost", "failure"]
    assert _decide(tmp_path, on=on) == ("RESTART", 137)
    assert "restarting in the allocation, restart 1 of at most 3" in merged_text(tmp_path)
    assert _decide(tmp_path, on=on, exclude_failed_node=True) == ("REQUEUE", 137)
    assert "requeuing, restart 1 of at most 3 in 0s, without n2" in merged_text(tmp_path)
    assert _decide(tmp_path, restart=3, on=on) == ("FAILED", 137)
    # As job.sbatch asks it for a per-node launcher (torchrun): the stall file, then per_node.
    stalled = str(tmp_path / "stalled")
    assert _decide(tmp_path, 0, 3, stalled, "per_node", on=on) == ("RESTART", 137)


def test_the_workers_of_a_torchrun_job_end_as_their_nodes_process() -> None:
    """Only a node's one process writes an exit (under its node's first rank); its workers
    follow it, so a COMPLETED torchrun job's ranks are all COMPLETED (issue #33)."""
    inv = plans.inventory(plans.gpu_node("n1", 2), plans.gpu_node("n2", 2))
    spec = plans.job(backend="slurm", launcher="torchrun",
                     resources={"nodes": 2, "gpus_per_node": 2})
    plan = plans.plan(spec, inv)
    ok, killed = Exit(code=0), Exit(code=1)
    exits = {0: RankEnd(0, "n1", ok, 5.0), 2: RankEnd(2, "n2", killed, 6.0)}
    ended = with_workers(plan, exits)
    assert {r: (e.node, e.exit.code, e.at) for r, e in ended.items()} == {
        0: ("n1", 0, 5.0), 1: ("n1", 0, 5.0), 2: ("n2", 1, 6.0), 3: ("n2", 1, 6.0)}
    ranks = plans.job(backend="slurm", resources={"nodes": 2, "gpus_per_node": 2})
    assert with_workers(plans.plan(ranks, inv), exits) == exits  # every rank writes its own


#: torchrun's last lines when its second worker on the node was killed (as torchrun prints them).
TORCHRUN_REPORT = """\
[rank3]: Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_05:40:00
  host      : n2
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_the_failed_worker_of_a_torchrun_node_is_named_on_slurm(tmp_path: Path) -> None:
    """A node's task writes one exit (as its first rank) and one log; the job's failure names
    the worker torchrun's report names, with the node's log, and that worker alone is FAILED:
    the node's other ranks were stopped (issue #33, as local and SSH name it)."""
    inv = plans.inventory(plans.gpu_node("n1", 2), plans.gpu_node("n2", 2))
    plan = plans.plan(plans.job(backend="slurm", launcher="torchrun",
                                resources={"nodes": 2, "gpus_per_node": 2}), inv)
    _record(slurm_exit_dir(tmp_path, 0), 0, 0, 5_000_000, "n1")
    _record(slurm_exit_dir(tmp_path, 0), 2, 1, 6_000_000, "n2")
    rank_log(tmp_path, 2).parent.mkdir(parents=True)
    rank_log(tmp_path, 2).write_text(TORCHRUN_REPORT)
    exits = rank_exits(tmp_path, 0, plan)
    assert sorted(exits) == [0, 3]
    failure = job_failure(tmp_path, exits, plan)
    assert failure is not None
    assert failure.sentence() == "rank 3 on n2 failed with signal 9 (SIGKILL)"
    assert "exitcode  : -9 (pid: 4242)" in failure.last_lines[-4]
    ended = with_workers(plan, exits)
    assert {r: (e.node, e.exit.ok) for r, e in ended.items()} == {
        0: ("n1", True), 1: ("n1", True), 2: ("n2", False), 3: ("n2", False)}
    # Without the plan (or under launcher: ranks) the node's first rank carries it.
    assert sorted(rank_exits(tmp_path, 0)) == [0, 2]


def _two_spawn_nodes_failed(run_dir: Path) -> None:
    """n1's task (rank 0) ended first without a word; 0.4 s later n2's (rank 2), its worker 1
    (rank 3) saying why in the node's log: the worker that explains is the one named."""
    exits = slurm_exit_dir(run_dir, 0)
    _record(exits, 0, 1, 1_000_000, "n1")
    _record(exits, 2, 1, 1_400_000, "n2")
    rank_log(run_dir, 0).parent.mkdir(parents=True, exist_ok=True)
    rank_log(run_dir, 0).write_text("Killed\n")
    rank_log(run_dir, 2).write_text(
        "rank 3: the loss is not finite (nan) at step 5; training stopped\n"
        "torch.multiprocessing.spawn.ProcessRaisedException:\n\n"
        "-- Process 1 terminated with the following error:\n")


def test_a_per_node_workers_blame_reads_its_nodes_log(tmp_path: Path) -> None:
    inv = plans.inventory(plans.gpu_node("n1", 2), plans.gpu_node("n2", 2))
    plan = plans.plan(plans.job(backend="slurm", launcher="per_node",
                                resources={"nodes": 2, "gpus_per_node": 2}), inv)
    _two_spawn_nodes_failed(tmp_path)
    failure = job_failure(tmp_path, rank_exits(tmp_path, 0, plan), plan)
    assert failure is not None
    assert failure.sentence() == "rank 3 on n2 failed with exit code 1"


@pytest.mark.process
def test_monitor_decide_names_the_per_node_worker_that_explains(tmp_path: Path) -> None:
    _two_spawn_nodes_failed(tmp_path)
    (tmp_path / "exits").symlink_to(slurm_exit_dir(tmp_path, 0))
    assert _decide(tmp_path, launcher="per_node") == ("FAILED", 1)
    assert "rank 3 on n2 failed with exit code 1" in merged_text(tmp_path)
