"""The local backend end to end: real processes, real torch.distributed (gloo on CPU)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from orchestrate.diagnosis.rankpackage import folder as sidecar_folder
from orchestrate.hostside import host
from tests.support.fakesmi import fake_nvidia_smi
from tests.support.localcli import Cli

pytestmark = pytest.mark.process

DDP_PROGRAM = """
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} local {os.environ['LOCAL_RANK']} sum {t.item():.0f}", flush=True)
delay = float(os.environ.get("HOLD_S", "0"))
if delay:
    time.sleep(delay)
    dist.barrier()
dist.destroy_process_group()
"""


def _ddp_job(cli: Cli, name: str, hold_s: float = 0, nproc: int = 2) -> Path:
    cli.write("ddp.py", DDP_PROGRAM)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: {nproc}}}
        command: [python, ddp.py]
        env: {{HOLD_S: "{hold_s}"}}
        distributed: {{timeout_s: 60}}
        """)


def _wait_state(cli: Cli, job: str, states: set[str], timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        status = cli.status(job)
        if status["state"] in states or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _wait_ranks_running(cli: Cli, job: str, timeout: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cli.run("status", job).returncode != 0:  # not submitted yet
            time.sleep(0.2)
            continue
        status = cli.status(job)
        ranks = status["ranks"]
        assert isinstance(ranks, list)
        if all(r["pid"] for r in ranks) and status["state"] == "RUNNING":
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {job} never ran all ranks: {cli.status(job)}")


@pytest.mark.timeout(120)
def test_two_rank_ddp_job_completes_with_rank_prefixed_output(cli: Cli) -> None:
    job = _ddp_job(cli, "allreduce")
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("allreduce-1"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "[localhost:0] rank 0 local 0 sum 3" in lines
    assert "[localhost:1] rank 1 local 1 sum 3" in lines
    status = cli.status(cli.id("allreduce-1"))
    assert status["state"] == "COMPLETED"
    assert [r["exit_code"] for r in status["ranks"]] == [0, 0]
    run_dir = Path(str(status["run_dir"]))
    assert (run_dir / "logs" / "rank-1.log").read_text() == "rank 1 local 1 sum 3\n"
    assert host.job_pids(cli.id("allreduce-1")) == []


@pytest.mark.timeout(120)
def test_the_script_render_prints_is_what_runs(cli: Cli) -> None:
    job = _ddp_job(cli, "same")
    job_id = f"same-{uuid.uuid4().hex[:8]}"
    rendered = cli.run("render", str(job), "--job-id", job_id, check=True).stdout
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
    status = _wait_state(cli, job_id, {"COMPLETED", "FAILED"}, 60)
    run_dir = Path(str(status["run_dir"]))
    shown = {name: text for name, text in (
        chunk.split(" <==\n", 1) for chunk in rendered[4:].split("\n==> "))}
    sidecar = [f"sidecar/{name}" for name in sidecar_folder()]
    assert "sidecar/sitecustomize.py" in sidecar
    assert list(shown) == ["launch-localhost.sh", *sidecar]
    for name, text in shown.items():  # byte for byte, the rank sidecar included
        assert text.rstrip("\n") == (run_dir / name).read_text().rstrip("\n"), name


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_killed_rank_fails_the_job_fast_and_leaves_nothing(cli: Cli) -> None:
    job = _ddp_job(cli, "victim", hold_s=120)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("victim-1"), check=True)
    status = _wait_ranks_running(cli, cli.id("victim-1"))
    time.sleep(3)  # let the ranks reach their collective
    victim = next(r for r in status["ranks"] if r["rank"] == 1)  # type: ignore[union-attr]
    pids = host.job_pids(cli.id("victim-1"))
    target = next(p for p in pids if _is_python_rank(p, 1))
    killed_at = time.monotonic()
    os.kill(target, signal.SIGKILL)
    final = _wait_state(cli, cli.id("victim-1"), {"FAILED", "COMPLETED", "CANCELLED"}, 30)
    assert time.monotonic() - killed_at < 10
    assert final["state"] == "FAILED"
    failure = final["failure"]
    assert isinstance(failure, dict)
    assert failure["rank"] == 1 and failure["signal"] == signal.SIGKILL
    assert victim["node"] == failure["node"] == "localhost"
    assert "rank 1" in str(final["reason"])
    time.sleep(0.5)
    assert host.job_pids(cli.id("victim-1")) == []


def _is_python_rank(pid: int, rank: int) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return "python" in exe and f"RANK={rank}".encode() in env


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_cancel_stops_every_process(cli: Cli) -> None:
    job = cli.write("sleepy.yaml", """
        name: sleepy
        resources: {nodes: 1, gpus_per_node: 2}
        command: [bash, -c, "sleep 300 & sleep 300; wait"]
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("sleepy-1"), check=True)
    _wait_ranks_running(cli, cli.id("sleepy-1"))
    time.sleep(0.3)
    # two ranks, each with a background child
    assert len(host.job_pids(cli.id("sleepy-1"))) >= 4
    started = time.monotonic()
    out = cli.run("cancel", "sleepy", check=True).stdout
    assert "CANCELLED" in out
    assert time.monotonic() - started < 10
    assert host.job_pids(cli.id("sleepy-1")) == []
    assert cli.status(cli.id("sleepy-1"))["state"] == "CANCELLED"


@pytest.mark.timeout(120)
def test_ctrl_c_on_follow_cancels_the_job(cli: Cli) -> None:
    job = cli.write("sleepy.yaml", """
        name: sleepy
        resources: {nodes: 1, gpus_per_node: 2}
        command: [sleep, "300"]
        """)
    proc = cli.popen("submit", str(job), "--follow", "--job-id", cli.id("ctrlc-1"))
    _wait_ranks_running(cli, cli.id("ctrlc-1"))
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130, proc.stderr
    assert cli.status(cli.id("ctrlc-1"))["state"] == "CANCELLED"
    assert host.job_pids(cli.id("ctrlc-1")) == []


@pytest.mark.timeout(120)
def test_early_exit_with_code_zero_is_reported(cli: Cli) -> None:
    cli.env["ORCHESTRATE_EARLY_EXIT_NOTICE_S"] = "1"  # not 10 s: rank 0 outlives it by 3 s
    job = cli.write("early.yaml", """
        name: early
        resources: {nodes: 1, gpus_per_node: 2}
        command: [bash, -c, 'if [ "$RANK" = 1 ]; then exit 0; fi; sleep 4']
        """)
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("early-1"), timeout=60)
    assert proc.returncode == 0
    assert "[orchestrate] rank 1 on localhost exited 0 more than" in proc.stdout
    assert "still run" in str(cli.status(cli.id("early-1"))["reason"])


@pytest.mark.timeout(120)
def test_logs_follow_streams_a_running_job(cli: Cli) -> None:
    job = cli.write("ticker.yaml", """
        name: ticker
        resources: {nodes: 1, gpus_per_node: 1}
        command: [bash, -c, 'for i in 1 2 3 4 5; do echo "tick $i"; sleep 0.5; done']
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("ticker-1"), check=True)
    proc = cli.run("logs", "ticker", "--follow", timeout=60, check=True)
    ticks = [line for line in proc.stdout.splitlines() if line.startswith("[localhost:")]
    assert ticks == [f"[localhost:0] tick {i}" for i in range(1, 6)]
    rank_log = cli.run("logs", cli.id("ticker-1"), "--rank", "0", check=True).stdout
    assert rank_log.splitlines() == [f"tick {i}" for i in range(1, 6)]


GPU_INVENTORY = """
name: shared-server
nodes:
  - name: localhost
    address: 127.0.0.1
    gpus:
      - {model: A100-80GB, memory_gb: 80, indices: [0, 1]}
      - {model: RTX-A6000, memory_gb: 48, indices: [2, 3, 4, 5, 6, 7]}
"""


@pytest.mark.timeout(120)
def test_two_jobs_share_a_server_on_disjoint_gpus_and_ports(cli: Cli) -> None:
    bin_dir = fake_nvidia_smi(cli.work / "bin", [
        (0, "A100-80GB", 81920), (1, "A100-80GB", 81920),
        *[(i, "RTX-A6000", 49140) for i in range(2, 8)],
    ])
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    cli.write("inv.yaml", GPU_INVENTORY)
    job = cli.write("half.yaml", """
        name: half
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 3, gpu_model: RTX-A6000}
        distributed: {backend: gloo, master_port: auto}
        command: [bash, -c, 'echo "$CUDA_VISIBLE_DEVICES $MASTER_PORT"; sleep 30']
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("half-a"), check=True)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("half-b"), check=True)
    third = cli.run("submit", str(job), "--detach", "--job-id", cli.id("half-c"))
    assert third.returncode == 75  # EX_TEMPFAIL: it fits once they end
    assert "held by other jobs" in third.stderr
    a, b = (_wait_ranks_running(cli, j) for j in (cli.id("half-a"), cli.id("half-b")))
    plans = [json.loads((Path(str(s["run_dir"])) / "plan.json").read_text()) for s in (a, b)]
    gpus = [set(p["nodes"][0]["cuda_visible_devices"].split(",")) for p in plans]
    assert gpus[0].isdisjoint(gpus[1])
    assert gpus[0] | gpus[1] == {"2", "3", "4", "5", "6", "7"}
    assert plans[0]["master_port"] != plans[1]["master_port"]
    cli.run("cancel", cli.id("half-a"), cli.id("half-b"), check=True)
    # Once they are gone their leases are released and the GPUs are free again.
    again = cli.run("submit", str(job), "--detach", "--job-id", cli.id("half-d"))
    assert again.returncode == 0, again.stderr
    cli.run("cancel", cli.id("half-d"), check=True)


@pytest.mark.timeout(60)
def test_a_busy_derived_port_is_replaced_and_recorded(cli: Cli) -> None:
    import socket

    from orchestrate.core.plan.ports import derive_port

    job = cli.write("porty.yaml", """
        name: porty
        resources: {nodes: 1, gpus_per_node: 1}
        command: [bash, -c, 'echo "port=$MASTER_PORT"']
        """)
    busy = derive_port(cli.id("porty-1"))
    with socket.socket() as holder:
        holder.bind(("", busy))
        holder.listen()
        proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("porty-1"), check=True)
    plan = json.loads((cli.work / "runs" / cli.id("porty-1") / "plan.json").read_text())
    assert plan["master_port"] != busy
    assert f"port={plan['master_port']}" in proc.stdout


@pytest.mark.timeout(60)
def test_a_stale_lease_from_a_dead_supervisor_does_not_block(cli: Cli) -> None:
    """A lease whose holder is gone (and whose job left nothing running) holds nothing: a job
    that needs every CPU slot it claimed still runs, and the stale file is removed."""
    from orchestrate.hostside.leases import LeaseBook, new_lease

    book = LeaseBook(cli.env.get("ORCHESTRATE_LEASES"))  # this test's book (tests/conftest.py)
    ghost = new_lease("ghost-1", "localhost", [], os.cpu_count() or 1, None, [2**22 - 1])
    with book.locked():
        book.record(ghost)
    stale = Path(book.directory) / f"ghost-1@{os.geteuid()}.json"
    assert stale.exists()
    job = cli.write("after-ghost.yaml", """
        name: after-ghost
        resources: {nodes: 1, gpus_per_node: all}
        command: [python, -c, "print('ran')"]
        """)
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("after-ghost-1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ran" in proc.stdout
    assert not stale.exists()


@pytest.mark.timeout(60)
def test_secret_env_reaches_ranks_but_no_file(cli: Cli) -> None:
    job = cli.write("secret.yaml", """
        name: secret
        resources: {nodes: 1, gpus_per_node: 2}
        secret_env: [API_TOKEN]
        command:
          - bash
          - -c
          - 'test "$(printf %s "$API_TOKEN" | rev)" = eulav-t3rc3s && echo ok-$RANK'
        """)
    missing = cli.run("submit", str(job), "--detach", "--job-id", cli.id("secret-0"))
    assert missing.returncode == 2 and "API_TOKEN is not set" in missing.stderr
    cli.env["API_TOKEN"] = "s3cr3t-value"
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("secret-1"), check=True)
    assert "[localhost:0] ok-0" in proc.stdout and "[localhost:1] ok-1" in proc.stdout
    for path in [*cli.work.rglob("*"), *cli.home.rglob("*")]:
        if path.is_file():
            assert b"s3cr3t-value" not in path.read_bytes(), path


@pytest.mark.timeout(180)
def test_the_example_job_completes_with_metrics(cli: Cli) -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "digits" / "job.yaml"
    job_id = cli.id("digits-test")
    proc = cli.run("submit", str(example), "--follow", "--job-id", job_id, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    status = cli.status(cli.id("digits-test"))
    assert status["state"] == "COMPLETED"
    assert status["first_step_at"] is not None
    metrics = [json.loads(line) for line in
               (Path(str(status["run_dir"])) / "metrics.jsonl").read_text().splitlines()]
    epochs = [m for m in metrics if m.get("kind") == "epoch"]
    assert len(epochs) == 8
    assert epochs[-1]["val_accuracy"] >= 0.93
    assert any(line.startswith("[localhost:0] epoch 8/8") for line in proc.stdout.splitlines())
