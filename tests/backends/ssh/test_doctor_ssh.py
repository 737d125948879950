"""`orchestrate doctor` and `submit --preflight` on real SSH hosts (tests/clusters/sshhosts.sh).

Each host has its own network namespace, so the faults are real and local to one host: a link
shaped with tc on one host's eth0, an interface the inventory names that one host lacks, the
master port starved on one host's way out, an interface that does not reach the other hosts.
The doctor runs through the SSH backend like the job would, and must name that host, and blame
no healthy one.

The hosts' python imports orchestrate from this checkout (the job's env sets PYTHONPATH), as a
cluster's nodes would have orchestrate installed.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.sshcli import SshCli

pytestmark = [pytest.mark.ssh, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[3]
#: Small and quick: the bandwidth tier's figures, not its defaults, are under test.
FAST = ["--sizes", "256K", "--pair-size", "2M", "--budget-s", "0.2", "--timeout-s", "15"]


def _job(cli: SshCli, name: str, nodes: int = 3, per_node: int = 1, extra: str = "") -> Path:
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: {nodes}, gpus_per_node: {per_node}}}
        command: [python, -c, "print('the job ran')"]
        env: {{PYTHONPATH: "{REPO}"}}
        {extra}
        """)


def _doctor(cli: SshCli, job: Path, *args: str, timeout: float = 150) -> tuple[
        subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = cli.run("doctor", str(job), "--json", *args, timeout=timeout)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout)


def _rows(doc: dict[str, Any], tier: str, status: str | None = None) -> list[dict[str, Any]]:
    return [c for c in doc["checks"] if c["tier"] == tier
            and (status is None or c["status"] == status)]


def _brief(doc: dict[str, Any]) -> str:
    """Every check on one line each, for a failing assertion."""
    return "\n".join(f"{c['tier']} {c['name']} {c['nodes']} {c['status']}: {c['detail']}"
                     for c in doc["checks"])


def _only_bandwidth_warnings(doc: dict[str, Any]) -> bool:
    """Whether everything passed but a bandwidth check's warning (a measured ratio)."""
    others = [c for c in doc["checks"] if c["status"] != "pass"]
    return bool(others) and all(c["tier"] == "bandwidth" and c["status"] == "warn"
                                for c in others)


def _in_host(host: str, command: str) -> None:
    """Run ``command`` in the host's network namespace (as its root would)."""
    subprocess.run(["ip", "netns", "exec", f"orch-{host}", "sh", "-c", command], check=True,
                   capture_output=True, text=True, timeout=20)


@contextmanager
def _qdisc(host: str, *commands: str) -> Iterator[None]:
    """tc on the host's eth0, removed afterwards whatever happens."""
    try:
        for command in commands:
            _in_host(host, command)
        yield
    finally:
        subprocess.run(["ip", "netns", "exec", f"orch-{host}", "tc", "qdisc", "del", "dev",
                        "eth0", "root"], capture_output=True, timeout=20, check=False)


@pytest.mark.timing
@pytest.mark.timeout(450)
def test_every_tier_passes_on_three_healthy_hosts(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": f"h{i}", "slots": 2} for i in (1, 2, 3)])
    job = _job(ssh_cli, "healthy")
    started = time.monotonic()
    proc, doc = _doctor(ssh_cli, job, "--tier", "all", *FAST)
    took = time.monotonic() - started
    for _ in range(2):
        if not _only_bandwidth_warnings(doc):
            break
        # The test hosts' links are veth pairs on this machine's CPUs: on a busy machine one
        # direction of a pair can measure 4x slower than the best for a moment, a real ratio
        # of what was measured, not a broken link (timing run T1 of 2026-12-05, load 16 on 2
        # cores: 6x, twice in a row). A ratio is measured up to three times before failing.
        print("doctor warned of a slow pair on a healthy box; once more:", _brief(doc))
        started = time.monotonic()
        proc, doc = _doctor(ssh_cli, job, "--tier", "all", *FAST)
        took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["verdict"] == "pass", [c for c in doc["checks"] if c["status"] != "pass"]
    assert {c["tier"] for c in doc["checks"]} == {"static", "connect", "smoke", "bandwidth"}
    assert set(doc) >= {"verdict", "checks", "bandwidth"}
    for check in doc["checks"]:
        assert set(check) >= {"tier", "name", "nodes", "status", "detail", "measured",
                              "expected"}
    # Every host answered for itself: facts, the route to the master, the clock.
    interface = {c["nodes"][0]: c for c in doc["checks"] if c["name"] == "interface"}
    assert sorted(interface) == ["h1", "h2", "h3"]
    assert all("eth0 is up and routes to the master" in c["detail"]
               for c in interface.values()), interface
    assert [c["nodes"] for c in doc["checks"] if c["name"] == "clock"] == [["h2"], ["h3"]]
    connect = {c["name"]: c for c in _rows(doc, "connect")}
    assert connect["master port"]["nodes"] == ["h1", "h2", "h3"]
    assert "6 of 6 node-to-node connection(s)" in connect["node-to-node ports"]["detail"]
    pairs = doc["bandwidth"]["pairs"]
    assert pairs["nodes"] == ["h1", "h2", "h3"]
    assert all((v is None) == (i == j) for i, row in enumerate(pairs["GBps"])
               for j, v in enumerate(row)), pairs
    assert all(row["busbw_GBps"] > 0 for row in doc["bandwidth"]["allreduce"])
    # The files, in the doctor job's run directory; the table's twin is the JSON.
    run_dir = Path(doc["doctor"]["run_dir"])
    assert json.loads((run_dir / "doctor.json").read_text())["verdict"] == "pass"
    page = (run_dir / "doctor.html").read_text()
    assert 'id="busbw"' in page and 'id="pairs"' in page
    assert took < 150, f"doctor took {took:.0f} s"


@pytest.mark.timeout(200)
def test_a_shaped_link_names_its_host_and_blames_no_healthy_pair(ssh_cli: SshCli) -> None:
    # 1 GbE declared (a floor of 0.1 GB/s per pair); h3's way out shaped to 100 Mb/s.
    ssh_cli.inventory([{"name": f"h{i}", "slots": 1,
                        "network": {"fabric": "ethernet", "interface": "eth0", "gbps": 1}}
                       for i in (1, 2, 3)])
    job = _job(ssh_cli, "shaped")
    with _qdisc("h3", "tc qdisc add dev eth0 root tbf rate 100mbit burst 32kbit "
                      "latency 400ms"):
        proc, doc = _doctor(ssh_cli, job, "--tier", "bandwidth", *FAST)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = [c for c in _rows(doc, "bandwidth") if c["status"] != "pass"]
    assert [(c["name"], c["nodes"], c["status"]) for c in bad] == [
        ("node h3", ["h3"], "fail")], _brief(doc)
    assert "every pair with h3 is slow" in bad[0]["detail"]
    healthy = next(c for c in _rows(doc, "bandwidth") if c["name"] == "node pairs")
    assert healthy["status"] == "pass" and "1 of 3 node pair(s) healthy" in healthy["detail"]
    assert doc["bandwidth"]["pairs"]["blamed_nodes"] == ["h3"]
    assert doc["bandwidth"]["pairs"]["blamed_links"] == []
    assert "failed: bandwidth node h3 (h3)" in proc.stderr


@pytest.mark.timeout(120)
def test_an_interface_missing_on_one_host_fails_static_naming_it(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1, "network": {"interface": "eth0"}},
                       {"name": "h2", "slots": 1, "network": {"interface": "eth9"}},
                       {"name": "h3", "slots": 1, "network": {"interface": "eth0"}}])
    job = _job(ssh_cli, "noiface")
    proc, doc = _doctor(ssh_cli, job, "--tier", "static")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = _rows(doc, "static", "fail")
    assert [(c["name"], c["nodes"]) for c in failed] == [("interface", ["h2"])], _brief(doc)
    assert failed[0]["detail"] == "eth9 does not exist on h2 (it has: eth0)"
    assert {c["tier"] for c in doc["checks"]} == {"static"}


@pytest.mark.timeout(120)
def test_an_unreachable_host_is_named_and_the_doctor_ends(ssh_cli: SshCli) -> None:
    ghost = dict(ssh_cli.hosts.hosts)["h1"].rsplit(".", 1)[0] + ".250"  # no sshd there
    ssh_cli.inventory([{"name": "h1", "slots": 1},
                       {"name": "ghost", "address": ghost, "slots": 1}])
    job = _job(ssh_cli, "ghosted", nodes=2)
    started = time.monotonic()
    proc, doc = _doctor(ssh_cli, job, "--tier", "smoke")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert [(c["tier"], c["name"], c["nodes"]) for c in failed] == [
        ("static", "launch", ["ghost"])], _brief(doc)
    assert f"ghost ({ghost}): ssh: unreachable" in failed[0]["detail"]
    assert doc["doctor"]["ended"] == "REFUSED"


@pytest.mark.timeout(120)
def test_a_master_port_unreachable_from_one_host_fails_connect_naming_it(
        ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": f"h{i}", "slots": 1} for i in (1, 2, 3)])
    port = 29611
    job = _job(ssh_cli, "blocked", extra=f"distributed: {{master_port: {port}}}")
    master = dict(ssh_cli.hosts.hosts)["h1"]
    # h3's packets to the master port go to an htb class at 8 bit/s: a DROP firewall without
    # iptables. The class starts with credit for one packet: a first SYN spends it.
    starve = [
        "tc qdisc add dev eth0 root handle 1: htb default 1",
        "tc class add dev eth0 parent 1: classid 1:1 htb rate 10gbit",
        "tc class add dev eth0 parent 1: classid 1:2 htb rate 8bit ceil 8bit burst 1b "
        "cburst 1b",
        "tc qdisc add dev eth0 parent 1:2 handle 20: pfifo limit 1",
        f"tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
        f"match ip dport {port} 0xffff flowid 1:2",
        f"python3 -c \"import socket; s = socket.socket(); s.settimeout(0.5); "
        f"s.connect_ex(('{master}', {port}))\"",
    ]
    with _qdisc("h3", *starve):
        proc, doc = _doctor(ssh_cli, job, "--tier", "connect", "--connect-window-s", "7")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = _rows(doc, "connect", "fail")
    assert failed and all(c["nodes"] == ["h3"] for c in failed), _brief(doc)
    master_row = next(c for c in failed if c["name"] == "master port")
    assert f"h3 cannot connect to the master h1:{port}: timeout" in master_row["detail"]
    passed = next(c for c in _rows(doc, "connect", "pass") if c["name"] == "master port")
    assert passed["nodes"] == ["h1", "h2"]
    assert not _rows(doc, "static", "fail")


@pytest.mark.timeout(240)
def test_submit_preflight_refuses_a_failing_smoke_and_submits_a_healthy_job(
        ssh_cli: SshCli) -> None:
    # h2's ranks are told to use loopback for gloo: they listen where no other host can reach.
    ssh_cli.inventory([{"name": "h1", "slots": 1, "network": {"interface": "eth0"}},
                       {"name": "h2", "slots": 1, "network": {"interface": "lo"}}])
    job = _job(ssh_cli, "pre", nodes=2)
    refused = ssh_cli.run("submit", str(job), "--preflight", "--detach", "--job-id", "pre-1",
                          timeout=150)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "preflight failed" in refused.stderr and "not submitted" in refused.stderr
    assert "smoke" in refused.stderr
    jobs = json.loads(ssh_cli.run("list", "--json", check=True).stdout)
    assert [j["id"] for j in jobs if not j["id"].startswith("pre-1-doctor-")] == []
    doctors = [p for p in (ssh_cli.work / "runs").iterdir() if "-doctor-" in p.name]
    doc = json.loads((doctors[0] / "doctor.json").read_text())
    assert [c["nodes"] for c in _rows(doc, "static", "fail")] == [["h2"]]
    assert _rows(doc, "smoke", "fail")

    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    accepted = ssh_cli.run("submit", str(job), "--preflight", "--detach", "--job-id", "pre-2",
                           timeout=150)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert accepted.stdout.strip() == "pre-2"
    status = ssh_cli.wait_state("pre-2", {"COMPLETED", "FAILED"}, timeout=60)
    assert status["state"] == "COMPLETED", status
    copied = json.loads((ssh_cli.work / "runs" / "pre-2" / "doctor.json").read_text())
    assert copied["verdict"] == "pass"
    assert copied["doctor"]["tiers"] == ["static", "health", "connect", "smoke"]
