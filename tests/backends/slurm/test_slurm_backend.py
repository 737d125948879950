"""The Slurm backend end to end, on the real test cluster (3 nodes, no accounting).

Every test drives the real CLI (or the Python API) against real slurmctld/slurmd daemons, with
ranks in their own network namespaces, and checks what a user would: the ranks of the plan, the
merged log, the failing rank, nothing left after a cancel, a requeue that resumes training to
the same parameters, a node failure reported as such.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrate.run.store import Store
from tests.support.checkpoints import differing_parameters, latest_state
from tests.support.clusters import BRING_UP
from tests.support.output import merged_text
from tests.support.slurmcli import TRAIN_JOB, OrchestrateCli
from tests.support.slurmcluster import BOTH_RELEASES

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[3]
SLURM_SH = REPO / "tests" / "clusters" / "slurm.sh"
# The first test that needs the cluster pays for `slurm.sh up` (see test_cluster.py).

# One rank: joins the gloo group through the torchrun variables alone, all-reduces its rank + 1,
# and reports what it was told and where it ran.
RANKS_PROGRAM = """
import datetime, json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "GLOO_SOCKET_IFNAME")
seen = {k: os.environ.get(k) for k in keys}
seen.update(hostname=socket.gethostname(), sum=value.item(), dist_rank=dist.get_rank())
print("seen " + json.dumps(seen, sort_keys=True), flush=True)
dist.destroy_process_group()
"""

# Prints its place in the job without torch (for layouts where only placement matters).
ENV_PROGRAM = """
import json, os, socket
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
seen = {k: os.environ.get(k) for k in keys}
seen["hostname"] = socket.gethostname()
print("seen " + json.dumps(seen, sort_keys=True), flush=True)
"""


def seen_lines(log: str) -> dict[int, dict[str, Any]]:
    """The ``seen {...}`` lines of the merged log, by rank, with their ``[node:rank]`` prefix."""
    found: dict[int, dict[str, Any]] = {}
    for line in log.splitlines():
        prefix, sep, rest = line.partition(" seen ")
        if not sep:
            continue
        seen = json.loads(rest)
        node, _, rank = prefix.strip("[]").partition(":")
        seen["prefix_node"], seen["prefix_rank"] = node, int(rank)
        found[int(seen["RANK"])] = seen
    return found


def plan_json(ocli: OrchestrateCli, job: Path) -> dict[str, Any]:
    plan: dict[str, Any] = json.loads(ocli.run("plan", str(job), "--json", check=True).stdout)
    return plan


def assert_matches_plan(seen: dict[int, dict[str, Any]], plan: dict[str, Any],
                        hosts: dict[str, str]) -> None:
    """Every rank got the plan's numbers and ran where the plan put it; ``hosts`` maps plan
    nodes to the hosts Slurm gave them."""
    assert sorted(seen) == list(range(plan["world_size"]))
    nodes = {n["name"]: n for n in plan["nodes"]}
    master = hosts[plan["nodes"][0]["name"]]
    for entry in plan["ranks"]:
        got = seen[entry["rank"]]
        node = nodes[entry["node"]]
        host = hosts[entry["node"]]
        assert int(got["LOCAL_RANK"]) == entry["local_rank"], got
        assert int(got["WORLD_SIZE"]) == plan["world_size"], got
        assert int(got["GROUP_RANK"]) == entry["node_rank"], got
        assert int(got["LOCAL_WORLD_SIZE"]) == node["nproc"], got
        assert got["hostname"] == host == got["prefix_node"], got
        assert got["prefix_rank"] == entry["rank"]
        assert got["MASTER_ADDR"] == master, got


def write_program(ocli: OrchestrateCli, name: str, text: str) -> None:
    (ocli.work / name).write_text(text)


def job_processes(job_id: str) -> tuple[list[int], list[int]]:
    """The live processes of a Slurm job on any node: (tasks, slurmstepds). A task carries the
    job id in its environment; a zombie is gone, whatever kill -0 says."""
    tasks, stepds = [], []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        if cmdline.startswith(f"slurmstepd: [{job_id}.".encode()):
            stepds.append(int(proc.name))
        elif f"SLURM_JOB_ID={job_id}\0".encode() in environ:
            tasks.append(int(proc.name))
    return tasks, stepds


def assert_nothing_left(job_id: str) -> None:
    """No task of the job runs any more; its slurmstepds finish within seconds (Slurm already
    reports the job ended while they clean up)."""
    tasks, stepds = job_processes(job_id)
    assert tasks == [], f"tasks of job {job_id} still running: {tasks}"
    deadline = time.monotonic() + 15
    while stepds:
        assert time.monotonic() < deadline, f"slurmstepds of job {job_id} left: {stepds}"
        time.sleep(0.2)
        tasks, stepds = job_processes(job_id)
        assert tasks == []


# ---- placement ---------------------------------------------------------------------------


@BOTH_RELEASES
@pytest.mark.torch
@pytest.mark.timeout(BRING_UP + 120)
def test_ddp_job_on_two_nodes_gets_the_plans_ranks(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    write_program(ocli, "ranks.py", RANKS_PROGRAM)
    job = ocli.write("ddp.yaml", """\
        name: ddp
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2, time: "5"}
        command: [python, ranks.py]
        distributed: {timeout_s: 60}
        """)
    plan = plan_json(ocli, job)
    proc, job_id = ocli.followed(job, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = ocli.status(job_id)
    assert status["state"] == "COMPLETED"
    assert status["external_id"]
    run_dir = Path(status["run_dir"])
    seen = seen_lines(merged_text(run_dir))
    hosts = {n["name"]: seen[n["first_rank"]]["hostname"] for n in plan["nodes"]}
    assert len(set(hosts.values())) == 2
    assert_matches_plan(seen, plan, hosts)
    assert {s["sum"] for s in seen.values()} == {10.0}  # 1 + 2 + 3 + 4: one process group
    assert {s["GLOO_SOCKET_IFNAME"] for s in seen.values()} == {
        "eth0" if ocli.cluster.layout == "netns" else "lo"
    }
    # The derived port: from the Slurm job id, as the plan says.
    assert {int(s["MASTER_PORT"]) for s in seen.values()} == {
        20000 + int(status["external_id"]) % 12000
    }
    # --follow printed the merged log; each rank's own file holds its lines unprefixed.
    assert "[orchestrate] all 4 rank(s) exited 0" in proc.stdout
    for rank in range(4):
        own = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert own.startswith("seen "), own
    assert [r["state"] for r in status["ranks"]] == ["COMPLETED"] * 4
    assert [r["host"] for r in status["ranks"]] == [seen[r]["hostname"] for r in range(4)]


@pytest.mark.torch
@pytest.mark.timeout(BRING_UP + 150)
def test_uneven_layouts_three_plus_two(ocli: OrchestrateCli) -> None:
    """3 + 2 ranks: on named nodes in the job's order (n3 before n1), and on nodes Slurm picks."""
    ocli.inventory(slots={"n1": 2, "n2": 3, "n3": 3})
    write_program(ocli, "ranks.py", RANKS_PROGRAM)
    write_program(ocli, "env.py", ENV_PROGRAM)
    pinned = ocli.write("pinned.yaml", """\
        name: pinned
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: all, node_names: [n3, n1], time: "5"}
        command: [python, ranks.py]
        distributed: {timeout_s: 60}
        """)
    # Without named nodes Slurm picks the hosts; the plan's 3 + 2 still holds on them.
    ocli.inventory("free-inventory.yaml", slots={"n1": 3, "n2": 2, "n3": 2})
    free = ocli.write("free.yaml", """\
        name: free
        inventory: free-inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: all}
        command: [python, env.py]
        """)
    plans = {"pinned": plan_json(ocli, pinned), "free": plan_json(ocli, free)}
    assert [(n["name"], n["nproc"]) for n in plans["pinned"]["nodes"]] == [("n3", 3), ("n1", 2)]
    assert [n["nproc"] for n in plans["free"]["nodes"]] == [3, 2]
    script = ocli.run("render", str(pinned), check=True).stdout
    assert '#SBATCH --nodelist="n[3,1]"' in script.splitlines()
    jobs = {"pinned": ocli.submit(pinned), "free": ocli.submit(free)}
    for name, job_id in jobs.items():
        status = ocli.wait(job_id, {"COMPLETED", "FAILED"}, timeout=120)
        log = merged_text(Path(status["run_dir"]))
        assert status["state"] == "COMPLETED", log
        seen = seen_lines(log)
        plan = plans[name]
        if name == "free":
            hosts = {n["name"]: seen[n["first_rank"]]["hostname"] for n in plan["nodes"]}
            assert len(set(hosts.values())) == 2
        else:  # named nodes run exactly there, in the job's order
            hosts = {n["name"]: n["name"] for n in plan["nodes"]}
        assert_matches_plan(seen, plan, hosts)
        if name == "pinned":
            assert seen[0]["hostname"] == "n3" and seen[3]["hostname"] == "n1"
            assert {s["sum"] for s in seen.values()} == {15.0}  # 1 + 2 + 3 + 4 + 5


# ---- failure, cancel, tracking ----------------------------------------------------------


FAILING_PROGRAM = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} up", flush=True)
if rank == 2:
    time.sleep(1)
    print("rank 2: giving up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""


@pytest.mark.timing
@pytest.mark.timeout(BRING_UP + 90)
def test_first_failing_rank_is_named_and_the_others_stop(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    write_program(ocli, "failing.py", FAILING_PROGRAM)
    job = ocli.write("failing.yaml", """\
        name: failing
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2}
        command: [python, failing.py]
        """)
    started = time.monotonic()
    proc, job_id = ocli.followed(job, timeout=90)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = ocli.status(job_id)
    assert status["state"] == "FAILED"
    failure = status["failure"]
    assert (failure["rank"], failure["exit_code"]) == (2, 3)
    assert failure["node"] == status["ranks"][2]["host"]
    assert failure["last_lines"][-1] == "rank 2: giving up"
    assert status["reason"].startswith(f"rank 2 on {failure['node']} failed with exit code 3")
    assert "last lines of rank 2" in proc.stderr
    assert took < 60, "the other ranks (sleeping 120 s) were not stopped"
    # Only rank 2 failed; the others were stopped because of it.
    assert [r["state"] for r in status["ranks"]] == ["STOPPED", "STOPPED", "FAILED", "STOPPED"]
    # Slurm agrees, without accounting: FAILED with the rank's exit code.
    info = ocli.cluster.job(status["external_id"])
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0")
    assert_nothing_left(status["external_id"])


@BOTH_RELEASES
@pytest.mark.timeout(BRING_UP + 60)
def test_cancel_leaves_nothing_running(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    job = ocli.write("sleeper.yaml", """\
        name: sleeper
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2}
        command: [sleep, "600"]
        """)
    job_id, status = ocli.submitted(job, {"RUNNING"}, timeout=30)
    slurm_id = status["external_id"]
    deadline = time.monotonic() + 20
    while len(job_processes(slurm_id)[0]) < 8:  # each rank: its shell and its sleep
        assert time.monotonic() < deadline, "the job's processes never appeared"
        time.sleep(0.2)

    proc = ocli.run("cancel", job_id, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"job {job_id} CANCELLED"
    status = ocli.status(job_id)
    assert status["state"] == "CANCELLED"
    assert {r["state"] for r in status["ranks"]} == {"STOPPED"}  # stopped, none failed
    assert_nothing_left(slurm_id)
    assert ocli.cluster.run("squeue", "-h", "-j", slurm_id, check=False).stdout.strip() == ""
    assert ocli.cluster.job(slurm_id)["JobState"] == "CANCELLED"


@BOTH_RELEASES
@pytest.mark.timeout(BRING_UP + 60)
def test_state_without_accounting_and_after_the_controller_forgot(ocli: OrchestrateCli) -> None:
    """sacct does not work here; a job that died is still seen as ended, even once the
    controller no longer knows it (decided from what the script left in the run directory)."""
    ocli.inventory()
    write_program(ocli, "failing.py", FAILING_PROGRAM.replace("time.sleep(120)", "pass"))
    job = ocli.write("dies.yaml", """\
        name: dies
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2}
        command: [python, failing.py]
        """)
    job_id, status = ocli.submitted(job, {"FAILED"}, timeout=60)
    sacct = ocli.cluster.run("sacct", "-j", status["external_id"], check=False)
    assert sacct.returncode != 0  # no accounting: the state above came from scontrol
    assert status["failure"]["rank"] == 2

    # As if MinJobAge had passed (or the controller lost its state): an id it never knew.
    store = Store(ocli.home / "jobs.db")
    store.update(job_id, state="RUNNING", external_id="999999999", reason="", failure=None,
                 finished_at=None)
    forgotten = ocli.status(job_id)
    assert forgotten["state"] == "FAILED"
    assert forgotten["failure"]["rank"] == 2
    assert forgotten["reason"].startswith("rank 2 on ")
    # ... and a job whose run never ended (its batch host died): ended, not waited for.
    events = Path(status["run_dir"]) / "slurm" / "events.jsonl"
    events.write_text(events.read_text().splitlines()[0] + "\n")  # keep only the start
    store.update(job_id, state="RUNNING", reason="", failure=None, finished_at=None)
    lost = ocli.status(job_id)
    assert lost["state"] == "FAILED"
    assert "never finished" in lost["reason"]


@pytest.mark.timeout(BRING_UP + 60)
def test_dry_run_prints_the_script_and_checks_it_with_test_only(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    job = ocli.write("check.yaml", """\
        name: check
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2, time: "00:10:00", cpus_per_task: 1}
        command: [python, -c, "print('hi')"]
        slurm: {signal_seconds_before: 60, extra_args: ["--comment=a comment"]}
        """)
    good = ocli.run("submit", str(job), "--dry-run", check=True)
    assert "sbatch --test-only: " in good.stderr and "to start at" in good.stderr
    script = good.stdout.split("==> job.sbatch <==\n", 1)[1].split("\n==> ", 1)[0]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=debug",
                 "#SBATCH --time=00:10:00", "#SBATCH --signal=USR2@60", "#SBATCH --requeue",
                 '#SBATCH --comment="a comment"', "#SBATCH --cpus-per-task=1"):
        assert line in script.splitlines()
    path = ocli.work / "check.sbatch"
    path.write_text(script)
    lint = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stdout
    assert not (ocli.work / "runs").exists(), "a dry run writes nothing"

    bad = ocli.run("submit", str(job), "--dry-run", "--set", "slurm.partition=nosuch")
    assert bad.returncode == 2, bad.stderr
    assert "sbatch --test-only refused the script" in bad.stderr
    assert "partition" in bad.stderr and "Traceback" not in bad.stderr

    # No controller answering: printed, not checked, not an error.
    away = dict(ocli.env, SLURM_CONF=str(ocli.work / "missing.conf"))
    unchecked = ocli.run("submit", str(job), "--dry-run", env=away)
    assert unchecked.returncode == 0, unchecked.stderr
    assert "not checked with sbatch --test-only" in unchecked.stderr


# ---- requeue and resume -----------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.timeout(BRING_UP + 360)
def test_stop_signal_checkpoints_requeues_and_resumes_to_the_same_parameters(
    ocli: OrchestrateCli,
) -> None:
    ocli.inventory()
    digits = REPO / "examples" / "digits"
    straight = ocli.write("straight.yaml", TRAIN_JOB.format(name="straight", workdir=digits))
    stopped = ocli.write("stopped.yaml", TRAIN_JOB.format(name="stopped", workdir=digits))
    straight_id = ocli.submit(straight)
    stopped_id = ocli.submit(stopped)
    status = ocli.wait(stopped_id, {"RUNNING"}, timeout=60)
    run = Path(status["run_dir"])
    deadline = time.monotonic() + 90
    while "epoch 1/6" not in merged_text(run):
        assert time.monotonic() < deadline, merged_text(run) or "no log"
        time.sleep(0.1)
    # What Slurm does signal_seconds_before the time limit: the stop signal to every rank.
    ocli.cluster.run("scancel", "--signal=USR2", status["external_id"])
    requeued = ocli.wait(stopped_id, {"REQUEUED", "FAILED", "COMPLETED"}, timeout=60)
    assert requeued["state"] == "REQUEUED", requeued["reason"]
    assert "checkpointed on the stop signal" in requeued["reason"]

    done = ocli.wait(stopped_id, {"COMPLETED", "FAILED"}, timeout=180)
    text = merged_text(run)
    assert done["state"] == "COMPLETED", text[-3000:]
    assert "after 1 requeue" in done["reason"]
    assert "exiting 75 to be requeued" in text
    assert "requeuing, restart 1 of at most 2" in text
    assert "resuming from" in text
    reference = ocli.wait(straight_id, {"COMPLETED", "FAILED"}, timeout=180)
    assert reference["state"] == "COMPLETED"
    assert "resuming" not in merged_text(Path(reference["run_dir"]))

    a = latest_state(Path(reference["run_dir"]))
    b = latest_state(Path(done["run_dir"]))
    assert a["step"] == b["step"] > 0
    assert differing_parameters(a, b) == []


SIGNAL_PROGRAM = """\
#!/usr/bin/env bash
# Stands in for a training loop: on the stop signal, "checkpoint" and ask for a requeue.
trap 'echo "rank $RANK got the stop signal"; exit 75' USR2
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then echo "rank $RANK resumed"; exit 0; fi
sleep 300 &
wait
"""


@BOTH_RELEASES
@pytest.mark.timeout(BRING_UP + 180)
def test_slurm_sends_the_stop_signal_before_the_time_limit(ocli: OrchestrateCli) -> None:
    """--signal=USR2@60 with a 2-minute limit: Slurm itself signals the ranks (not only the
    batch shell) 30-60 s after the start (it checks every 30 s), they exit 75, the script
    requeues, and the second run completes."""
    ocli.inventory()
    write_program(ocli, "loop.sh", SIGNAL_PROGRAM)
    job = ocli.write("limited.yaml", """\
        name: limited
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 1, time: "2"}
        command: [bash, loop.sh]
        slurm: {signal_seconds_before: 60}
        restart: {max: 1}
        """)
    _, done = ocli.submitted(job, {"COMPLETED", "FAILED", "TIMEOUT"}, timeout=150)
    log = merged_text(Path(done["run_dir"]))
    assert done["state"] == "COMPLETED", log
    assert "got the stop signal" in log and "resumed" in log
    assert ocli.cluster.job(done["external_id"])["Restarts"] == "1"


# ---- node failure -----------------------------------------------------------------------


NODE_PROGRAM = """\
#!/usr/bin/env bash
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then echo "rank $RANK: run 2 on $(hostname)"; exit 0; fi
echo "rank $RANK: up on $(hostname)"
exec sleep 300
"""


def slurm_sh(*args: str) -> None:
    proc = subprocess.run([str(SLURM_SH), *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(BRING_UP + 200)
def test_node_failure_requeues_or_fails_as_configured(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    write_program(ocli, "node.sh", NODE_PROGRAM)
    requeue = ocli.write("requeue.yaml", """\
        name: requeue
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 3, gpus_per_node: 1}
        command: [bash, node.sh]
        """)
    no_requeue = ocli.write("norequeue.yaml", """\
        name: norequeue
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 1, gpus_per_node: 1, node_names: [n3]}
        command: [bash, node.sh]
        restart: {on: [requeue]}
        """)
    assert "#SBATCH --no-requeue" in ocli.run("render", str(no_requeue), check=True).stdout
    a = ocli.submit(requeue)
    b = ocli.submit(no_requeue)
    for job_id in (a, b):
        ocli.wait(job_id, {"RUNNING"}, timeout=30)
        status = ocli.status(job_id)
        run = Path(status["run_dir"])
        deadline = time.monotonic() + 30
        while merged_text(run).count(": up on ") < len(status["ranks"]):
            assert time.monotonic() < deadline, merged_text(run)
            time.sleep(0.2)
    try:
        slurm_sh("kill-node", "n3")  # a power cut: slurmd, slurmstepds and ranks at once
        failed = ocli.wait(b, {"NODE_FAIL", "FAILED", "COMPLETED"}, timeout=90)
        assert failed["state"] == "NODE_FAIL", failed
        assert "node failure" in failed["reason"] and "not requeued" in failed["reason"]
        again = ocli.wait(a, {"REQUEUED", "FAILED", "NODE_FAIL"}, timeout=90)
        assert again["state"] == "REQUEUED", again
        assert "node failure" in again["reason"] and "n3" in again["reason"]
    finally:
        slurm_sh("start-node", "n3")
    done = ocli.wait(a, {"COMPLETED", "FAILED"}, timeout=90)
    log = merged_text(Path(done["run_dir"]))
    assert done["state"] == "COMPLETED", log
    assert log.count(": run 2 on ") == 3
    assert "stopped by SIGTERM" in log  # the first run's batch script saw the node go


# ---- the Python API ---------------------------------------------------------------------


def where_am_i(scale: int) -> dict[str, Any]:
    """Runs on every rank: a gloo all-reduce through the plan's environment."""
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")
    return {**{k: int(os.environ[k]) for k in keys}, "host": socket.gethostname(),
            "sum": value.item() * scale}


def dies_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # no result, no traceback: gone
    time.sleep(60)
    return 0


@pytest.mark.torch
@pytest.mark.timeout(BRING_UP + 150)
def test_submit_function_returns_every_ranks_result(
    ocli: OrchestrateCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrate
    from orchestrate.backends.slurm.function import FunctionJobFailed

    ocli.inventory()
    job = ocli.write("fn.yaml", """\
        name: fn
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2, time: "5"}
        command: [python]
        """)
    for name, value in ocli.env.items():
        if name.startswith(("SLURM_CONF", "ORCHESTRATE_")):
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(ocli.work)
    # The ranks unpickle this test module's functions: they must import it by name.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    plan = plan_json(ocli, job)
    results = orchestrate.submit_function(where_am_i, job, 2, timeout_s=120)
    assert [r["RANK"] for r in results] == [0, 1, 2, 3]
    assert [r["LOCAL_RANK"] for r in results] == [e["local_rank"] for e in plan["ranks"]]
    assert [r["GROUP_RANK"] for r in results] == [e["node_rank"] for e in plan["ranks"]]
    assert {r["WORLD_SIZE"] for r in results} == {4}
    assert {r["sum"] for r in results} == {20.0}
    assert results[0]["host"] == results[1]["host"] != results[2]["host"] == results[3]["host"]

    started = time.monotonic()
    with pytest.raises(FunctionJobFailed) as failed:
        orchestrate.submit_function(dies_on_rank_1, job, timeout_s=120)
    assert time.monotonic() - started < 90, "waited for a job that was gone"
    assert " ended FAILED without a result" in str(failed.value)
    assert "rank 1 on" in str(failed.value)
    listed = json.loads(ocli.run("list", "--json", check=True).stdout)
    assert [j["state"] for j in listed] == ["FAILED", "COMPLETED"]



def raises_on_rank_1() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1":
        time.sleep(1)  # the others are already waiting in the collective
        raise ValueError("rank 1 broke on purpose")
    value = torch.ones(1)
    dist.all_reduce(value)  # the others fail here: the connection rank 1 closed
    return int(value.item())


@pytest.mark.torch
@pytest.mark.timeout(BRING_UP + 150)
def test_submit_function_raises_the_root_cause_not_a_peers_secondary_error(
    ocli: OrchestrateCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    from submitit.core.utils import FailedJobError

    import orchestrate

    ocli.inventory()
    job = ocli.write("fn-raise.yaml", """\
        name: fn-raise
        inventory: inventory.yaml
        backend: slurm
        resources: {nodes: 2, gpus_per_node: 2, time: "5"}
        distributed: {timeout_s: 30}
        command: [python]
        """)
    for name, value in ocli.env.items():
        if name.startswith(("SLURM_CONF", "ORCHESTRATE_")):
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(ocli.work)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(FailedJobError) as raised:
        orchestrate.submit_function(raises_on_rank_1, job, timeout_s=120)
    assert "rank 1 broke on purpose" in str(raised.value)


@pytest.mark.timeout(BRING_UP + 120)
def test_a_submit_while_the_controller_is_frozen_is_tracked_not_lost(
    ocli: OrchestrateCli,
) -> None:
    """sbatch times out against a stopped slurmctld, but Slurm queues the job once the
    controller wakes: the job is recorded at once (SUBMITTING) and found afterwards, and it is
    never submitted twice."""
    ocli.inventory()
    name = f"frozen-{os.getpid()}-{int(time.time())}"
    job = ocli.write("frozen.yaml", f"""\
        name: {name}
        inventory: inventory.yaml
        backend: slurm
        resources: {{nodes: 1, gpus_per_node: 1}}
        command: [bash, -c, "echo ran once"]
        """)
    ctld = int((ocli.cluster.state_dir / "pids" / "slurmctld.pid").read_text())
    ocli.cluster.quiet(timeout=60)  # no earlier step may be ending while the controller sleeps
    os.kill(ctld, signal.SIGSTOP)
    try:
        proc = ocli.run("submit", str(job), "--detach", timeout=60)
        status_while_frozen = ocli.run("status", "--json", timeout=60)
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "may still be queued" in proc.stderr
    job_id = proc.stdout.strip()
    assert json.loads(status_while_frozen.stdout)["state"] == "SUBMITTING"
    done = ocli.wait(job_id, {"COMPLETED", "FAILED"}, timeout=90)
    assert done["state"] == "COMPLETED", done
    assert done["external_id"] is not None
    log = merged_text(Path(done["run_dir"]))
    assert log.count("ran once") == 1
    named = ocli.cluster.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout
    assert named.split() == [done["external_id"]]
