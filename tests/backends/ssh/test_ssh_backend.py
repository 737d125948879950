"""The SSH backend end to end on real sshd hosts (own network, PID and UTS namespace each): the
real CLI, real torch.distributed (gloo) across hosts, real kills. Nothing mocked but the GPUs (a
stand-in ``nvidia-smi`` reached through the inventory's python wrapper, since no GPU exists
here). A host sees and kills only its own processes, so a stop that works here works because
the backend reached every host, not because one host's kill-by-tag swept them all."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.plan.ports import derive_port
from tests.support.labserver import gpu_node, gpu_python, lease_book
from tests.support.output import merged_text
from tests.support.sshcli import SshCli, assert_nothing_left
from tests.support.sshhosts import stop_tagged, tagged_by_namespace, tagged_on

pytestmark = pytest.mark.ssh
#: This checkout (what the tests test, wherever orchestrate is installed).
REPO = Path(__file__).resolve().parents[3]

DDP_PROGRAM = """
import datetime, json, os, socket, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "GLOO_SOCKET_IFNAME")
print(json.dumps({**{k: os.environ.get(k) for k in keys}, "host": socket.gethostname(),
                  "sum": t.item()}), flush=True)
hold = float(os.environ.get("HOLD_S", "0"))
if hold:
    time.sleep(hold)
    dist.barrier()
dist.destroy_process_group()
"""


def _ddp_job(cli: SshCli, name: str, nodes: int, per_node: int | str = "all",
             hold_s: float = 0) -> Path:
    cli.write("ddp.py", DDP_PROGRAM)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: {nodes}, gpus_per_node: {per_node}}}
        command: [python, ddp.py]
        env: {{HOLD_S: "{hold_s}"}}
        distributed: {{timeout_s: 60}}
        """)


def _reports(stdout: str) -> list[tuple[str, dict[str, Any]]]:
    """(prefix, record) of every JSON line the ranks printed."""
    found = []
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if prefix.startswith("[h") and rest.startswith("{"):
            found.append((prefix, json.loads(rest)))
    return found


def _check_ranks_against_plan(cli: SshCli, job: Path, job_id: str, stdout: str) -> None:
    plan = json.loads(cli.run("plan", str(job), "--job-id", job_id, "--json", check=True).stdout)
    reports = _reports(stdout)
    assert len(reports) == plan["world_size"], stdout
    by_rank = {int(r["RANK"]): (prefix, r) for prefix, r in reports}
    for rank in plan["ranks"]:
        prefix, report = by_rank[rank["rank"]]
        assert prefix == f"[{rank['node']}:{rank['rank']}]"
        assert int(report["LOCAL_RANK"]) == rank["local_rank"]
        assert int(report["GROUP_RANK"]) == rank["node_rank"]
        assert report["host"] == rank["node"]  # ran on that machine, not just labelled so
        assert int(report["WORLD_SIZE"]) == plan["world_size"]
        assert report["MASTER_ADDR"] == plan["master_addr"]
        # Discovered at submit on each host: the inventory names no interface.
        assert report["GLOO_SOCKET_IFNAME"] == "eth0"
        assert report["sum"] == plan["world_size"] * (plan["world_size"] + 1) / 2


@pytest.mark.torch
@pytest.mark.timeout(150)
def test_two_hosts_two_ranks_each_run_as_planned(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 2}])
    job = _ddp_job(ssh_cli, "ddp", nodes=2)
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "ddp-1", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_ranks_against_plan(ssh_cli, job, "ddp-1", proc.stdout)
    status = ssh_cli.status("ddp-1")
    assert status["state"] == "COMPLETED"
    assert status["hosts"] == [address for _, address in ssh_cli.hosts.hosts[:2]]
    assert [(r["node"], r["host"]) for r in status["ranks"]] == [
        ("h1", "h1"), ("h1", "h1"), ("h2", "h2"), ("h2", "h2")]
    run_dir = Path(status["run_dir"])
    assert '"RANK": "3"' in (run_dir / "logs" / "rank-3.log").read_text()
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert_nothing_left(ssh_cli, "ddp-1")


@pytest.mark.torch
@pytest.mark.timeout(150)
def test_uneven_three_plus_two(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 3}, {"name": "h2", "slots": 2}])
    job = _ddp_job(ssh_cli, "uneven", nodes=2, per_node="all")
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "uneven-1", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_ranks_against_plan(ssh_cli, job, "uneven-1", proc.stdout)
    hosts = sorted((int(r["RANK"]), r["host"], r["LOCAL_WORLD_SIZE"])
                   for _, r in _reports(proc.stdout))
    assert hosts == [(0, "h1", "3"), (1, "h1", "3"), (2, "h1", "3"), (3, "h2", "2"),
                     (4, "h2", "2")]


@pytest.mark.timing
@pytest.mark.torch
@pytest.mark.timeout(150)
def test_killed_rank_fails_the_job_fast_and_leaves_nothing(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 2}])
    job = _ddp_job(ssh_cli, "victim", nodes=2, hold_s=120)
    status = ssh_cli.submitted(job, "victim-1")
    run = Path(status["run_dir"])
    deadline = time.monotonic() + 60
    while merged_text(run).count('"sum"') < 4 and time.monotonic() < deadline:
        time.sleep(0.2)  # every rank is past its all-reduce, waiting in the barrier
    victim = status["ranks"][3]
    assert (victim["node"], victim["host"]) == ("h2", "h2")
    # kill -9 the rank's python on its host, found by the job's tag and its RANK.
    kill = (
        "for p in /proc/[0-9]*; do "
        "grep -qzx ORCHESTRATE_JOB_ID=victim-1 $p/environ 2>/dev/null && "
        "grep -qzx RANK=3 $p/environ && readlink $p/exe | grep -q python && "
        "echo ${p#/proc/} && kill -9 ${p#/proc/}; done; true"
    )
    killed_at = time.monotonic()
    result = ssh_cli.hosts.run("h2", kill)
    assert result.stdout.split() == [str(victim["pid"])], result.stderr
    final = ssh_cli.wait_state("victim-1", {"FAILED", "COMPLETED", "CANCELLED"}, 30)
    assert time.monotonic() - killed_at < 10
    assert final["state"] == "FAILED"
    failure = final["failure"]
    assert (failure["rank"], failure["node"], failure["signal"]) == (3, "h2", signal.SIGKILL)
    assert "rank 3 on h2" in final["reason"]
    assert_nothing_left(ssh_cli, "victim-1")


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_lost_host_fails_the_job_naming_it_and_the_others_are_stopped(ssh_cli: SshCli) -> None:
    """A host dies whole: its PID namespace is SIGKILLed, ranks, agent and sshd at once (what a
    kernel panic looks like to the processes; its TCP peers still get a reset). The job fails
    naming a rank on that host, not one the backend stopped elsewhere afterwards, and nothing of
    the job is left on the hosts that remain. With one PID space for all hosts, a kill-by-tag on
    any host could not be told apart from the per-host stop this needs."""
    hosts = ssh_cli.hosts
    ssh_cli.inventory([{"name": n, "slots": 2} for n, _ in hosts.hosts])
    job = ssh_cli.write("sleepy.yaml", SLEEPY)
    ssh_cli.submitted(job, "lost-1")
    assert set(tagged_by_namespace(hosts, "lost-1")) == {"h1", "h2", "h3"}
    try:
        os.kill(hosts.init_pid("h2"), signal.SIGKILL)
        lost_at = time.monotonic()
        final = ssh_cli.wait_state("lost-1", {"FAILED", "NODE_FAIL", "COMPLETED", "CANCELLED"},
                                   60)
        took = time.monotonic() - lost_at
        assert final["state"] == "NODE_FAIL", final
        assert final["failure"]["node"] == "h2", final
        assert final["failure"]["rank"] in (2, 3), final
        assert final["reason"].startswith("lost contact with h2"), final
        assert took < 20, f"the job noticed the lost host after {took:.1f}s"
        survivors = ["h1", "h3"]
        left = tagged_on(hosts, "lost-1", survivors)
        seen = tagged_by_namespace(hosts, "lost-1")
        assert not left and not seen, f"left on the survivors: {left}; by namespace: {seen}"
    finally:
        again = subprocess.run(["bash", str(hosts.script), "up", str(len(hosts.hosts))],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=100, check=False)
    assert again.returncode == 0, again.stderr  # h2 back for the tests that follow


@pytest.mark.timing
@pytest.mark.timeout(180)
def test_a_host_cut_off_the_network_is_named_within_seconds(ssh_cli: SshCli) -> None:
    """The silent partition: h2's link goes down while its ranks compute outside any
    collective. No reset arrives; the SSH keepalives go unanswered, and within about 20 s the
    job is NODE_FAIL naming h2 (not a rank elsewhere that failed afterwards). Once the link is
    back, h2's own sshd and agent have stopped everything of the job there."""
    hosts = ssh_cli.hosts
    ssh_cli.inventory([{"name": n, "slots": 1} for n, _ in hosts.hosts])
    job = ssh_cli.write("quiet.yaml", """
        name: quiet
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 3, gpus_per_node: 1}
        command: [bash, -c, "sleep 300"]
        restart: {max: 0}
        """)
    ssh_cli.submitted(job, "cut-1")
    veth = "orch-v2"
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    cut_at = time.monotonic()
    try:
        final = ssh_cli.wait_state("cut-1", {"FAILED", "NODE_FAIL", "CANCELLED", "COMPLETED"}, 90)
        took = time.monotonic() - cut_at
        assert final["state"] == "NODE_FAIL", final
        assert final["reason"].startswith("lost contact with h2"), final
        assert final["failure"]["node"] == "h2" and final["failure"]["rank"] == 1
        assert took < 30, f"the cut-off host was named after {took:.1f}s"
        assert not tagged_on(hosts, "cut-1", ["h1", "h3"])
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    deadline = time.monotonic() + 40
    while tagged_by_namespace(hosts, "cut-1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not tagged_by_namespace(hosts, "cut-1"), "h2 kept the job's processes"


@pytest.mark.timing
@pytest.mark.timeout(180)
def test_cancel_with_a_cut_off_host_returns_within_seconds(ssh_cli: SshCli) -> None:
    hosts = ssh_cli.hosts
    ssh_cli.inventory([{"name": n, "slots": 1} for n, _ in hosts.hosts])
    job = ssh_cli.write("quiet.yaml", """
        name: quiet
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 2, gpus_per_node: 1}
        command: [bash, -c, "sleep 300"]
        """)
    ssh_cli.submitted(job, "cutcancel-1")
    subprocess.run(["ip", "link", "set", "orch-v2", "down"], check=True)
    try:
        started = time.monotonic()
        done = ssh_cli.run("cancel", "cutcancel-1", timeout=120)
        took = time.monotonic() - started
        assert done.returncode == 0, done.stdout + done.stderr
        assert ssh_cli.status("cutcancel-1")["state"] == "CANCELLED"
        assert took < 25, f"cancel took {took:.1f}s with h2 cut off"
        assert not tagged_on(hosts, "cutcancel-1", ["h1"])
    finally:
        subprocess.run(["ip", "link", "set", "orch-v2", "up"], check=True)
    deadline = time.monotonic() + 40
    while tagged_by_namespace(hosts, "cutcancel-1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not tagged_by_namespace(hosts, "cutcancel-1"), "h2 kept the job's processes"


SLEEPY = """
    name: sleepy
    backend: ssh
    inventory: inv.yaml
    resources: {nodes: 3, gpus_per_node: 2}
    command: [bash, -c, "sleep 300 & sleep 300; wait"]
    restart: {max: 0}
    """


@pytest.mark.timeout(120)
def test_killed_supervisor_leaves_nothing_on_any_host(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": n, "slots": 2} for n, _ in ssh_cli.hosts.hosts])
    job = ssh_cli.write("sleepy.yaml", SLEEPY)
    status = ssh_cli.submitted(job, "orphan-1")
    time.sleep(0.5)
    assert set(tagged_on(ssh_cli.hosts, "orphan-1")) == {"h1", "h2", "h3"}
    assert [r["state"] for r in status["ranks"]] == ["RUNNING"] * 6
    os.kill(_supervisor_pid(ssh_cli, "orphan-1"), signal.SIGKILL)
    killed_at = time.monotonic()
    while tagged_by_namespace(ssh_cli.hosts, "orphan-1") and time.monotonic() - killed_at < 15:
        time.sleep(0.1)
    gone_after = time.monotonic() - killed_at
    assert_nothing_left(ssh_cli, "orphan-1")
    assert gone_after < 8, f"processes outlived their controller by {gone_after:.1f}s"
    final = ssh_cli.status("orphan-1")
    assert final["state"] == "FAILED"
    assert "supervisor" in final["reason"]


def _supervisor_pid(cli: SshCli, job: str) -> int:
    with sqlite3.connect(cli.home / "jobs.db") as conn:
        (pid,) = conn.execute("SELECT supervisor_pid FROM jobs WHERE id = ?", [job]).fetchone()
    return int(pid)


@pytest.mark.timeout(120)
def test_cancel_stops_every_process_on_every_host(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": n, "slots": 2} for n, _ in ssh_cli.hosts.hosts])
    job = ssh_cli.write("sleepy.yaml", SLEEPY)
    ssh_cli.submitted(job, "sleepy-1")
    started = time.monotonic()
    out = ssh_cli.run("cancel", "sleepy-1", check=True).stdout
    assert "CANCELLED" in out
    assert time.monotonic() - started < 10
    assert_nothing_left(ssh_cli, "sleepy-1")
    assert ssh_cli.status("sleepy-1")["state"] == "CANCELLED"


@pytest.mark.timeout(120)
def test_ctrl_c_on_follow_cancels_everywhere(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": n, "slots": 2} for n, _ in ssh_cli.hosts.hosts])
    job = ssh_cli.write("sleepy.yaml", SLEEPY)
    cli = subprocess.Popen(
        [sys.executable, "-m", "orchestrate", "submit", str(job), "--follow", "--job-id",
         "ctrlc-1"], cwd=ssh_cli.work, env=ssh_cli.env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        ssh_cli.wait_running("ctrlc-1")
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, err
    assert "cancelling job ctrlc-1" in err
    assert ssh_cli.status("ctrlc-1")["state"] == "CANCELLED"
    assert_nothing_left(ssh_cli, "ctrlc-1")


@pytest.mark.timeout(120)
def test_cancel_without_a_supervisor_kills_by_tag_on_every_host(ssh_cli: SshCli) -> None:
    """The controller and the hosts' agents are gone (say the controller crashed and the agents
    were OOM-killed) and the ranks ignore SIGHUP: `cancel` still stops them, by tag, from here."""
    ssh_cli.inventory([{"name": n, "slots": 1} for n, _ in ssh_cli.hosts.hosts])
    job = ssh_cli.write("stubborn.yaml", """
        name: stubborn
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 3, gpus_per_node: 1}
        command: [bash, -c, "trap '' HUP; sleep 300 & sleep 300; wait"]
        """)
    status = ssh_cli.submitted(job, "stubborn-1")
    # Each rank's agent on its host; the pids in `status` are the hosts' own.
    agents = [_parent(ssh_cli.hosts.root_pid(r["node"], r["pid"])) for r in status["ranks"]]
    supervisor = _supervisor_pid(ssh_cli, "stubborn-1")
    os.kill(supervisor, signal.SIGSTOP)  # frozen, it sees nothing of what follows
    for pid in agents:
        os.kill(pid, signal.SIGKILL)  # no agent left to stop the ranks by tag
    os.kill(supervisor, signal.SIGKILL)
    time.sleep(1)
    assert set(tagged_on(ssh_cli.hosts, "stubborn-1")) == {"h1", "h2", "h3"}  # orphans
    started = time.monotonic()
    out = ssh_cli.run("cancel", "stubborn-1", check=True).stdout
    assert "CANCELLED" in out
    assert time.monotonic() - started < 15
    assert_nothing_left(ssh_cli, "stubborn-1")


def _address(cli: SshCli, host: str) -> str:
    return dict(cli.hosts.hosts)[host]


def _parent(pid: int) -> int:
    """The parent of a root-namespace pid, as a root-namespace pid."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_unreachable_host_fails_preflight_fast_and_launches_nothing(ssh_cli: SshCli) -> None:
    ghost = _address(ssh_cli, "h1").rsplit(".", 1)[0] + ".250"  # on the test network, no sshd
    nodes = [{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1},
             {"name": "ghost", "address": ghost, "slots": 1}]
    ssh_cli.inventory(nodes)
    job = ssh_cli.write("wide.yaml", """
        name: wide
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 3, gpus_per_node: 1}
        command: [bash, -c, "sleep 30"]
        """)
    started = time.monotonic()
    proc = ssh_cli.run("submit", str(job), "--detach", "--job-id", "wide-1", timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert took < 15, f"preflight took {took:.1f}s"
    assert f"ghost ({ghost}): ssh: unreachable" in proc.stderr
    assert "preflight: what failed" in proc.stderr  # the table, before the errors
    assert "Traceback" not in proc.stderr
    assert_nothing_left(ssh_cli, "wide-1")
    assert ssh_cli.run("status", "wide-1").returncode == 2  # never became a job


@pytest.mark.timeout(120)
def test_busy_master_port_fixed_is_refused_and_auto_moves(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    busy = derive_port("porty-2")
    holder = subprocess.Popen(  # a listener in the master host's own port space
        ["ip", "netns", "exec", "orch-h1", sys.executable, "-c",
         "import socket, time; s = socket.socket(); "
         "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         f"s.bind(('', {busy})); s.listen(); print('up', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "up\n"
        # The controller's own port space is free: only a check on h1 finds the listener.
        fixed = ssh_cli.write("fixed.yaml", f"""
            name: porty
            backend: ssh
            inventory: inv.yaml
            resources: {{nodes: 2, gpus_per_node: 1}}
            distributed: {{master_port: {busy}}}
            command: [bash, -c, 'echo "port=$MASTER_PORT"']
            """)
        refused = ssh_cli.run("submit", str(fixed), "--detach", "--job-id", "porty-1")
        assert refused.returncode == 2
        h1 = _address(ssh_cli, "h1")
        assert f"h1 ({h1}): port: master port {busy} is in use on h1" in refused.stderr
        auto = ssh_cli.write("auto.yaml", """
            name: porty
            backend: ssh
            inventory: inv.yaml
            resources: {nodes: 2, gpus_per_node: 1}
            command: [bash, -c, 'echo "port=$MASTER_PORT"']
            """)
        proc = ssh_cli.run("submit", str(auto), "--follow", "--job-id", "porty-2", check=True)
    finally:
        holder.kill()
        holder.wait()
    plan = json.loads((ssh_cli.work / "runs" / "porty-2" / "plan.json").read_text())
    assert plan["master_port"] != busy
    assert f"[h2:1] port={plan['master_port']}" in proc.stdout


@pytest.mark.timeout(150)
def test_two_jobs_share_a_host_on_disjoint_gpus_and_ports(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([gpu_node(ssh_cli)], python=gpu_python(ssh_cli))
    template = """
        name: half
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 1, gpus_per_node: 3, gpu_model: RTX-A6000}}
        distributed: {{backend: gloo, master_port: {port}}}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES port=$MASTER_PORT"; sleep 60']
        """
    # Job b derives the port job a holds by lease; nothing listens on it (the ranks are
    # shells), so only the lease on the host keeps b off it.
    taken = derive_port("half-b")
    job_a = ssh_cli.write("a.yaml", template.format(port=taken))
    job_b = ssh_cli.write("b.yaml", template.format(port="auto"))
    ssh_cli.run("submit", str(job_a), "--detach", "--job-id", "half-a", check=True)
    ssh_cli.run("submit", str(job_b), "--detach", "--job-id", "half-b", check=True)
    third = ssh_cli.run("submit", str(job_b), "--detach", "--job-id", "half-c")
    assert third.returncode == 75, third.stderr  # EX_TEMPFAIL: it fits once they end
    assert "held by other jobs" in third.stderr
    a, b = (ssh_cli.wait_running(j) for j in ("half-a", "half-b"))
    plans = [json.loads((Path(s["run_dir"]) / "plan.json").read_text()) for s in (a, b)]
    gpus = [set(p["nodes"][0]["cuda_visible_devices"].split(",")) for p in plans]
    assert gpus[0].isdisjoint(gpus[1])
    assert gpus[0] | gpus[1] == {"2", "3", "4", "5", "6", "7"}
    assert plans[0]["master_port"] == taken != plans[1]["master_port"]
    leases = lease_book(ssh_cli)
    held = {p.stem.split("@")[0]: json.loads(p.read_text()) for p in leases.glob("half-*.json")}
    assert set(held) == {"half-a", "half-b"}
    assert sorted(held["half-b"]["gpus"]) == sorted(int(g) for g in gpus[1])
    ssh_cli.run("cancel", "half-a", "half-b", check=True)
    assert_nothing_left(ssh_cli, "half-a")
    assert_nothing_left(ssh_cli, "half-b")
    # Released: nothing holds the GPUs as h1's agent sees it (a lease whose holders are gone
    # is stale, and h1's book drops it on that read).
    seen = json.loads(ssh_cli.run("gpus", "--json", "--inventory", str(ssh_cli.work / "inv.yaml"),
                                  check=True).stdout)
    assert not [h for g in seen[0]["gpus"] for h in g["holders"]], seen
    assert not list(leases.glob("half-*.json"))  # released
    again = ssh_cli.run("submit", str(job_b), "--detach", "--job-id", "half-d")
    assert again.returncode == 0, again.stderr
    ssh_cli.run("cancel", "half-d", check=True)


@pytest.mark.timeout(90)
def test_unknown_host_key_is_refused_unless_the_inventory_accepts_it(
    ssh_cli: SshCli, tmp_path: Path
) -> None:
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    job = ssh_cli.write("keys.yaml", """
        name: keys
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 1}
        command: [bash, -c, 'echo "on $(hostname)"']
        """)
    ssh_cli.inventory([{"name": "h1", "slots": 1}], known_hosts_file=str(empty))
    refused = ssh_cli.run("submit", str(job), "--detach", "--job-id", "keys-1")
    assert refused.returncode == 2
    h1 = _address(ssh_cli, "h1")
    assert f"h1 ({h1}): host key: unknown host key for {h1}:22" in refused.stderr

    # A key that does not match is refused even when unknown keys are accepted.
    h2_key = next(line.split(None, 1)[1] for line in
                  ssh_cli.hosts.known_hosts.read_text().splitlines() if line.startswith("h2,"))
    forged = tmp_path / "known_hosts_forged"
    forged.write_text(f"{h1} {h2_key}\n")
    ssh_cli.inventory([{"name": "h1", "slots": 1}], known_hosts_file=str(forged),
                      accept_unknown_host_keys=True)
    spoofed = ssh_cli.run("submit", str(job), "--detach", "--job-id", "keys-2")
    assert spoofed.returncode == 2
    assert "does NOT match known_hosts" in spoofed.stderr

    ssh_cli.inventory([{"name": "h1", "slots": 1}], known_hosts_file=str(empty),
                      accept_unknown_host_keys=True)
    accepted = ssh_cli.run("submit", str(job), "--follow", "--job-id", "keys-3", check=True)
    assert "[h1:0] on h1" in accepted.stdout
    assert empty.read_text() == ""  # trusted for this connection, never written


@pytest.mark.timeout(90)
def test_secret_reaches_every_rank_but_no_file(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    check = 'test "$(printf %s "$API_TOKEN" | rev)" = eulav-t3rc3s && echo ok-$RANK'
    job = ssh_cli.write("secret.yaml", f"""
        name: secret
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: 1}}
        secret_env: [API_TOKEN]
        command: [bash, -c, '{check}']
        """)
    missing = ssh_cli.run("submit", str(job), "--detach", "--job-id", "secret-0")
    assert missing.returncode == 2 and "API_TOKEN is not set" in missing.stderr
    ssh_cli.env["API_TOKEN"] = "s3cr3t-value"
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "secret-1", check=True)
    assert "[h1:0] ok-0" in proc.stdout and "[h2:1] ok-1" in proc.stdout
    assert "s3cr3t" not in proc.stdout + proc.stderr  # the pty did not echo it
    # The hosts share this filesystem: the remote run dirs and lease books are here too.
    roots = [ssh_cli.work, ssh_cli.home, Path.home() / ".local/state/orchestrate"]
    for path in (p for root in roots if root.exists() for p in root.rglob("*")):
        if path.is_file():
            assert b"s3cr3t-value" not in path.read_bytes(), path


@pytest.mark.timeout(90)
def test_dry_run_shows_every_host_and_each_failed_check(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1},
                       {"name": "h2", "slots": 1, "python": "/nonexistent/python3"},
                       {"name": "h3", "slots": 1}])
    job = ssh_cli.write("checks.yaml", """
        name: checks
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 3, gpus_per_node: 1}
        workdir: /nonexistent-workdir
        command: [python, -c, "print(1)"]
        """)
    dry = ssh_cli.run("submit", str(job), "--dry-run", "--job-id", "checks-1")
    assert dry.returncode == 2
    assert "==> launch-h1.sh <==" in dry.stdout  # what would run, then the checks
    label = {name: f"{name} ({address})" for name, address in ssh_cli.hosts.hosts}
    assert f"{label['h2']}: python: /nonexistent/python3 not found on the host" in dry.stderr
    for host in (label["h1"], label["h3"]):
        assert f"{host}: workdir: /nonexistent-workdir does not exist" in dry.stderr
    assert "ok 2." in dry.stderr  # the torch column: import torch worked on h1 and h3


@pytest.mark.timeout(120)
def test_stale_leases_never_block_but_live_ones_do(ssh_cli: SshCli) -> None:
    """A lease is live while its holder process lives (same pid *and* start time) or while any
    process on the host carries its job's tag; anything else is stale and removed."""
    ssh_cli.inventory([gpu_node(ssh_cli)], python=gpu_python(ssh_cli))
    job = ssh_cli.write("grab.yaml", """
        name: grab
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 6, gpu_model: RTX-A6000}
        distributed: {backend: gloo}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"']
        """)
    leases = lease_book(ssh_cli)
    leases.mkdir(parents=True, exist_ok=True)
    # Lease holders are pids on h1, which has its own PID space: a pid that h1 used and freed.
    shell = ssh_cli.hosts.run("h1", "echo $$")
    assert shell.returncode == 0, shell.stderr
    gone = int(shell.stdout)

    def plant(job_id: str, holder_pid: int, holder_start: int) -> Path:
        path = leases / f"{job_id}@{os.geteuid()}.json"
        path.write_text(json.dumps({
            "job_id": job_id, "node": "h1", "hostname": "h1", "gpus": [2, 3, 4, 5, 6, 7],
            "port": None, "holder_pid": holder_pid, "holder_start": holder_start,
            "created": time.time()}))
        return path

    # Holder gone, nothing tagged: stale.
    ghost = plant("lease-ghost", gone, 12345)
    ok = ssh_cli.run("submit", str(job), "--follow", "--job-id", "grab-1", check=True)
    assert "[h1:0] gpus=2,3,4,5,6,7" in ok.stdout
    assert not ghost.exists()
    # The holder's pid now belongs to another process (start time differs): stale. Pid 1 is
    # alive on every host (h1's init) and did not start at tick 1.
    reused = plant("lease-reused", 1, 1)
    ssh_cli.run("submit", str(job), "--follow", "--job-id", "grab-2", check=True)
    assert not reused.exists()
    # Holder gone, but a process of that job still runs on h1: live, the GPUs stay taken.
    started = ssh_cli.hosts.run(
        "h1", "ORCHESTRATE_JOB_ID=lease-alive setsid sleep 120 </dev/null >/dev/null 2>&1 &")
    assert started.returncode == 0, started.stderr
    alive = plant("lease-alive", gone, 12345)
    try:
        refused = ssh_cli.run("submit", str(job), "--detach", "--job-id", "grab-3")
        assert refused.returncode == 75  # EX_TEMPFAIL: it fits once they end
        assert "6 held by other jobs" in refused.stderr
        assert alive.exists()
    finally:
        stop_tagged(ssh_cli.hosts, "lease-alive", grace_s=1.0)
    ssh_cli.run("submit", str(job), "--follow", "--job-id", "grab-4", check=True)
    assert not alive.exists()


@pytest.mark.timeout(180)
def test_a_local_job_and_an_ssh_job_on_one_machine_share_its_leaselease_book(
    ssh_cli: SshCli,
) -> None:
    """One lease format and one directory per machine, whichever backend launched the job: a
    local job run on h1 (its CLI started there) holds GPUs that an SSH job to h1 then cannot
    have; the SSH job is placed on the others, and refused when it needs the held ones."""
    wrapper = gpu_python(ssh_cli)
    ssh_cli.inventory([gpu_node(ssh_cli)], python=wrapper)
    local_inv = ssh_cli.write("local-inv.yaml", f"""
        name: h1-itself
        defaults: {{python: {wrapper}}}
        nodes:
          - name: h1
            address: 127.0.0.1
            lease_dir: {lease_book(ssh_cli).parent}
            gpus:
              - {{model: A100-80GB, memory_gb: 80, indices: [0, 1]}}
              - {{model: RTX-A6000, memory_gb: 48, indices: [2, 3, 4, 5, 6, 7]}}
        """)
    local_job = ssh_cli.write("local.yaml", f"""
        name: local-half
        backend: local
        inventory: {local_inv}
        resources: {{nodes: 1, gpus_per_node: 4, gpu_model: RTX-A6000}}
        distributed: {{backend: gloo}}
        command: [bash, -c, 'echo "local gpus=$CUDA_VISIBLE_DEVICES"; sleep 60']
        """)
    # The local backend, run on h1 as a user logged in there would (its own home state, the
    # default ~/.local/state/orchestrate, as the agent's).
    fakebin = Path(wrapper).parent
    # That home outlives the test hosts and job ids are never reused: a fresh id each run.
    local_id = f"local-half-{uuid.uuid4().hex[:8]}"
    # This checkout's orchestrate, not whatever is installed: a login has its own environment.
    started = ssh_cli.hosts.run(
        "h1", f"cd {ssh_cli.work} && PATH={fakebin}:$PATH ORCHESTRATE_RUNS={ssh_cli.work}/h1runs "
        f"PYTHONPATH={REPO} {sys.executable} -m orchestrate submit {local_job} --detach "
        f"--job-id {local_id}", timeout=90)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        leases = lease_book(ssh_cli)
        deadline = time.monotonic() + 30
        while not (leases / f"{local_id}@{os.geteuid()}.json").exists():
            assert time.monotonic() < deadline, "the local job never leased its GPUs"
            time.sleep(0.2)
        held = json.loads((leases / f"{local_id}@{os.geteuid()}.json").read_text())["gpus"]
        assert len(held) == 4 and set(held) <= {2, 3, 4, 5, 6, 7}

        # An SSH job for 2 A6000s gets the 2 the local job left free.
        ssh_job = ssh_cli.write("remote.yaml", """
            name: remote
            backend: ssh
            inventory: inv.yaml
            resources: {nodes: 1, gpus_per_node: 2, gpu_model: RTX-A6000}
            distributed: {backend: gloo}
            command: [bash, -c, 'echo "ssh gpus=$CUDA_VISIBLE_DEVICES"']
            """)
        ok = ssh_cli.run("submit", str(ssh_job), "--follow", "--job-id", "remote-1", timeout=120)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        got = next(line for line in ok.stdout.splitlines() if "ssh gpus=" in line)
        assert set(map(int, got.rsplit("=", 1)[1].split(","))).isdisjoint(held)
        # One that needs 3 A6000s finds only 2 free: refused, naming the other job's hold.
        three = ssh_cli.run("submit", str(ssh_job), "--detach", "--job-id", "remote-2",
                            "--set", "resources.gpus_per_node=3", timeout=120)
        assert three.returncode == 75, three.stdout + three.stderr  # EX_TEMPFAIL
        assert "4 held by other jobs" in three.stderr
    finally:
        ssh_cli.hosts.run("h1", f"cd {ssh_cli.work} && PYTHONPATH={REPO} {sys.executable} -m "
                          f"orchestrate cancel {local_id}", timeout=60)
        stop_tagged(ssh_cli.hosts, local_id, grace_s=1.0)
