"""What a hostile run of the local path broke, each reproduced on real processes and now held.

Orphans and collisions (a killed supervisor, a full disk, jobs without a bound, CPU slots),
then bad input that used to reach a traceback or do the wrong thing. GPUs cannot exist here: a
stand-in ``nvidia-smi`` on PATH answers where a job needs GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrate.backends.detached import WATCHDOG_NAME
from orchestrate.hostside import host
from tests.support.fakesmi import fake_nvidia_smi
from tests.support.localcli import Cli

pytestmark = pytest.mark.process

ONE_GPU_INVENTORY = """
name: one-gpu
nodes:
  - name: localhost
    address: 127.0.0.1
    gpus: [{model: A100-80GB, memory_gb: 80, indices: [0]}]
"""


def _wait(cli: Cli, job: str, states: set[str], timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        status = cli.status(job)
        if status["state"] in states or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _wait_running(cli: Cli, job: str, timeout: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cli.run("status", job).returncode == 0:
            status = cli.status(job)
            ranks = status["ranks"]
            assert isinstance(ranks, list)
            if status["state"] == "RUNNING" and all(r["pid"] for r in ranks):
                return status
        time.sleep(0.2)
    raise AssertionError(f"{job} never ran: {cli.status(job)}")


def _supervisor_pid(cli: Cli, job: str) -> int:
    db = sqlite3.connect(cli.home / "jobs.db")
    try:
        (pid,) = db.execute("SELECT supervisor_pid FROM jobs WHERE id = ?", [job]).fetchone()
    finally:
        db.close()
    return int(pid)


def _gone_within(job: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while host.job_pids(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not host.job_pids(job)


# ---- orphans, collisions and hangs -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_killed_supervisor_takes_its_ranks_and_holds_the_gpu_until_they_are_gone(
    cli: Cli,
) -> None:
    bin_dir = fake_nvidia_smi(cli.work / "bin", [(0, "A100-80GB", 81920)])
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    cli.write("inv.yaml", ONE_GPU_INVENTORY)
    # A rank that shrugs off SIGTERM: only SIGKILL, after the grace period, ends it.
    job = cli.write("stubborn.yaml", """
        name: stubborn
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 1}
        distributed: {backend: gloo}
        command: [bash, -c, "trap '' TERM; while true; do sleep 0.2; done"]
        """)
    first = cli.id("stubborn-1")
    cli.run("submit", str(job), "--detach", "--job-id", first, check=True)
    _wait_running(cli, first)
    os.kill(_supervisor_pid(cli, first), signal.SIGKILL)
    # While the rank still runs, its GPU stays leased: a second job cannot get GPU 0.
    refused = cli.run("submit", str(job), "--detach", "--job-id", cli.id("stubborn-2"))
    assert refused.returncode == 75, refused.stdout + refused.stderr  # EX_TEMPFAIL
    assert "held by other jobs" in refused.stderr
    # The watchdog stops the ranks (SIGKILL after the 5 s grace), with nobody running status.
    assert _gone_within(first, 15), host.job_pids(first)
    status = cli.status(first)
    assert status["state"] == "FAILED" and "vanished" in str(status["reason"])
    assert all(r["state"] != "RUNNING" for r in status["ranks"])  # type: ignore[union-attr]
    again = cli.run("submit", str(job), "--detach", "--job-id", cli.id("stubborn-3"), check=True)
    assert again.returncode == 0
    cli.run("cancel", cli.id("stubborn-3"), check=True)


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_a_full_run_directory_fails_the_job_and_says_why(cli: Cli) -> None:
    runs = cli.work / "runs"
    runs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(runs)], check=True)
    try:
        job = cli.write("chatty.yaml", """
            name: chatty
            resources: {nodes: 1, gpus_per_node: 2}
            command: [python, -c, "while True: print('x' * 200, flush=True)"]
            """)
        started = time.monotonic()
        proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("chatty-1"),
                       timeout=90)
        took = time.monotonic() - started
        assert proc.returncode == 1
        status = cli.status(cli.id("chatty-1"))
        assert status["state"] == "FAILED"
        assert "cannot write logs: No space left on device" in str(status["reason"])
        assert took < 45
        assert host.job_pids(cli.id("chatty-1")) == []
    finally:
        host.reap(cli.id("chatty-1"), 1.0)
        subprocess.run(["umount", "-l", str(runs)], check=False)


@pytest.mark.timeout(90)
def test_the_time_limit_is_enforced_on_local_as_slurm_does(cli: Cli) -> None:
    job = cli.write("slow.yaml", """
        name: slow
        resources: {nodes: 1, gpus_per_node: 2, time: "00:04"}
        command: [bash, -c, "trap 'echo got TERM; exit 75' TERM; sleep 120 & wait"]
        """)
    started = time.monotonic()
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("slow-1"), timeout=80)
    assert proc.returncode == 1
    status = cli.status(cli.id("slow-1"))
    assert status["state"] == "TIMEOUT", status
    assert "time limit (4s, resources.time) reached" in str(status["reason"])
    assert "got TERM" in proc.stdout  # the ranks were asked first: they could checkpoint
    assert time.monotonic() - started < 40
    assert host.job_pids(cli.id("slow-1")) == []


@pytest.mark.timeout(120)
def test_ranks_left_running_after_rank_0_finished_are_stopped_after_a_stated_grace(
    cli: Cli,
) -> None:
    # The production waits (a notice after 10 s, a stop 30 s past the timeout) shortened.
    cli.env.update(ORCHESTRATE_EARLY_EXIT_NOTICE_S="1", ORCHESTRATE_LINGER_SLACK_S="1")
    job = cli.write("linger.yaml", """
        name: linger
        resources: {nodes: 1, gpus_per_node: 2}
        distributed: {timeout_s: 5}
        command: [bash, -c, 'if [ "$RANK" = 0 ]; then exit 0; fi; sleep 300']
        """)
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("linger-1"), timeout=100)
    assert proc.returncode == 1
    status = cli.status(cli.id("linger-1"))
    assert status["state"] == "FAILED"
    assert "rank(s) [1] still ran" in str(status["reason"])
    assert "after rank 0 finished" in str(status["reason"])
    assert "they are stopped if still running 6s after it" in proc.stdout
    assert "(distributed.timeout_s + 1s)" in proc.stdout
    ranks = {r["rank"]: r for r in status["ranks"]}  # type: ignore[union-attr]
    assert ranks[0]["state"] == "COMPLETED" and ranks[1]["state"] == "STOPPED"


@pytest.mark.timeout(120)
def test_cpu_slots_are_leased_like_gpus(cli: Cli) -> None:
    job = cli.write("busy.yaml", """
        name: busy
        resources: {nodes: 1, gpus_per_node: all}
        command: [sleep, "60"]
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("busy-1"), check=True)
    _wait_running(cli, cli.id("busy-1"))
    cpus = os.cpu_count()
    second = cli.run("submit", str(job), "--detach", "--job-id", cli.id("busy-2"))
    assert second.returncode == 75, second.stdout + second.stderr  # EX_TEMPFAIL
    assert f"0 free slots ({cpus} held by other jobs)" in second.stderr
    cli.run("cancel", cli.id("busy-1"), check=True)
    third = cli.run("submit", str(job), "--detach", "--job-id", cli.id("busy-3"))
    assert third.returncode == 0, third.stderr
    cli.run("cancel", cli.id("busy-3"), check=True)


@pytest.mark.timeout(120)
def test_a_cancelled_jobs_ranks_are_stopped_not_failed(cli: Cli) -> None:
    job = cli.write("calm.yaml", """
        name: calm
        resources: {nodes: 1, gpus_per_node: 2}
        command: [sleep, "60"]
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("calm-1"), check=True)
    _wait_running(cli, cli.id("calm-1"))
    cli.run("cancel", cli.id("calm-1"), check=True)
    status = cli.status(cli.id("calm-1"))
    assert status["state"] == "CANCELLED"
    assert [r["state"] for r in status["ranks"]] == ["STOPPED", "STOPPED"]  # type: ignore[union-attr]


def _watchdog_of(job: str) -> int:
    """The job's watchdog (``python -S -c PROGRAM orchestrate-watchdog JOB``), found in /proc
    as ``ps`` shows it."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-S" in argv and argv[-3:-1] == [WATCHDOG_NAME.encode(), job.encode()]:
            return int(proc.name)
    raise AssertionError(f"no watchdog for {job}")


@pytest.mark.timeout(60)
def test_cancel_releases_the_lease_in_the_recorded_book_without_the_job_files(
    cli: Cli,
) -> None:
    """The inventory names a lease_dir; supervisor and watchdog are gone and ``loaded.json``
    is unreadable: ``cancel`` stops the rank and releases the lease in that book, the one the
    job's record names (review C9: it used to open the default book and leave the lease)."""
    book, default = cli.work / "book", cli.work / "default-book"
    cli.env["ORCHESTRATE_LEASES"] = str(default)
    cli.write("inv.yaml", f"""
        name: booked
        nodes:
          - {{name: localhost, address: 127.0.0.1, slots: 1, lease_dir: {book}}}
        """)
    job = cli.write("booked.yaml", """
        name: booked
        inventory: inv.yaml
        resources: {nodes: 1}
        command: [sleep, "60"]
        """)
    job_id = cli.id("booked")
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
    status = _wait_running(cli, job_id)
    assert len(list(book.glob(f"*/{job_id}@*.json"))) == 1
    for pid in (_watchdog_of(job_id), _supervisor_pid(cli, job_id)):
        os.kill(pid, signal.SIGKILL)
    (Path(str(status["run_dir"])) / "loaded.json").write_text("{not json")
    cli.run("cancel", job_id, check=True)
    assert _gone_within(job_id, 5), host.job_pids(job_id)
    assert not list(book.glob(f"*/{job_id}@*.json"))
    assert not list(default.glob(f"*/{job_id}@*.json"))


# ---- bad input: exit 2, the field, a hint, nothing launched or written -----------------------


def _quick_job(cli: Cli, name: str = "quick") -> Path:
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 1}}
        command: [python, -c, "print('hello')"]
        """)


@pytest.mark.parametrize("bad", ["..", "../../x", "/tmp/abs", "a/b", "-x"])
def test_job_ids_are_names_never_paths(cli: Cli, bad: str) -> None:
    proc = cli.run("submit", str(_quick_job(cli)), "--detach", "--job-id", bad)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--job-id" in proc.stderr
    assert not (cli.work / "runs").exists() and not (cli.home / "jobs.db").exists()


@pytest.mark.timeout(60)
def test_an_existing_job_id_is_refused_before_anything_is_touched(cli: Cli) -> None:
    job = _quick_job(cli)
    cli.run("submit", str(job), "--follow", "--job-id", cli.id("once"), check=True)
    run_dir = cli.work / "runs" / cli.id("once")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    again = cli.run("submit", str(job), "--follow", "--job-id", cli.id("once"))
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "exists already" in again.stderr and "orchestrate resume" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert cli.status(cli.id("once"))["state"] == "COMPLETED"


@pytest.mark.timeout(60)
def test_a_relative_orchestrate_home_is_the_same_store_for_the_supervisor(cli: Cli) -> None:
    cli.env["ORCHESTRATE_HOME"] = "relative-home"
    proc = cli.run("submit", str(_quick_job(cli)), "--follow", "--job-id", cli.id("rel"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hello" in proc.stdout
    assert (cli.work / "relative-home" / "jobs.db").exists()


@pytest.mark.parametrize("case", ["corrupt", "home-is-a-file"])
def test_a_broken_store_is_a_clear_error(cli: Cli, case: str) -> None:
    if case == "corrupt":
        cli.home.mkdir()
        (cli.home / "jobs.db").write_bytes(b"this is not a database" * 100)
    else:
        cli.home.write_text("a file where the state directory should be")
    for args in (("list",), ("status",), ("submit", str(_quick_job(cli)), "--detach")):
        proc = cli.run(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert "cannot use" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_a_read_only_home_is_a_clear_error(cli: Cli) -> None:
    cli.home.mkdir()
    subprocess.run(["mount", "--bind", str(cli.home), str(cli.home)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(cli.home)], check=True)
        for args in (("list",), ("status", "x")):
            proc = cli.run(*args)
            assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
            assert "Traceback" not in proc.stderr and "cannot use the job store" in proc.stderr
    finally:
        subprocess.run(["umount", "-l", str(cli.home)], check=False)


@pytest.mark.timeout(120)
def test_a_store_locked_for_longer_than_its_patience_never_decides_the_outcome(
    cli: Cli,
) -> None:
    """A job whose ranks all exit 0 while another process holds the store for 8 s (longer
    than the CLI's patience, shortened from 30 s to 2 s) is recorded COMPLETED once the lock
    goes, never FAILED. The supervisor keeps its own (900 s) patience."""
    cli.env["ORCHESTRATE_STORE_PATIENCE_S"] = "2"
    job = cli.write("patient.yaml", """
        name: patient
        resources: {nodes: 1, gpus_per_node: 1}
        command: [bash, -c, "sleep 4"]
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("patient-1"), check=True)
    _wait_running(cli, cli.id("patient-1"))
    locked, released = threading.Event(), threading.Event()

    def hold() -> None:
        holder = sqlite3.connect(cli.home / "jobs.db", isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(8)
        holder.execute("ROLLBACK")
        holder.close()
        released.set()

    threading.Thread(target=hold, daemon=True).start()
    locked.wait(10)
    # Reading still works (WAL); a command that must write says the store is busy.
    assert cli.run("status", cli.id("patient-1")).returncode == 0
    busy = cli.run("submit", str(_quick_job(cli)), "--detach")
    assert busy.returncode == 2 and "stayed locked for 2s" in busy.stderr
    assert "Traceback" not in busy.stderr
    released.wait(60)
    status = _wait(cli, cli.id("patient-1"), {"COMPLETED", "FAILED"}, 30)
    assert status["state"] == "COMPLETED", status


def test_input_that_used_to_crash_is_refused_with_the_field(cli: Cli, tmp_path: Path) -> None:
    latin1 = cli.work / "latin1.yaml"
    latin1.write_bytes(b"name: caf\xe9\ncommand: [python, x.py]\n")
    proc = cli.run("validate", str(latin1))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "latin1.yaml:1: not UTF-8 text (byte 0xe9" in proc.stderr
    # A run root that is a file: nothing launched, the field named.
    (cli.work / "not-a-dir").write_text("x")
    job = cli.write("rooted.yaml", """
        name: rooted
        run_root: not-a-dir
        command: [python, -c, "print(1)"]
        """)
    proc = cli.run("submit", str(job), "--detach")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "run_root: cannot write the run directory" in proc.stderr
    # render -o onto a file that exists.
    proc = cli.run("render", str(_quick_job(cli)), "-o", str(cli.work / "not-a-dir"))
    assert proc.returncode == 2 and "-o/--output: exists and is not a folder" in proc.stderr
    assert (cli.work / "not-a-dir").read_text() == "x"
    # A missing working directory is found before launch, not after.
    job = cli.write("nowhere.yaml", """
        name: nowhere
        workdir: does-not-exist
        command: [python, -c, "print(1)"]
        """)
    proc = cli.run("submit", str(job), "--detach")
    assert proc.returncode == 2 and "workdir: the working directory does not exist" in proc.stderr
    assert json.loads(cli.run("list", "--json").stdout) == []
