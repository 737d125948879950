"""The SSH test hosts behave like separate machines: what orchestrate's SSH backend relies on.

Each check is one a user would make on a real cluster: can I log in, is this the machine I think
it is, is the host key checked, does DDP across two machines add up, do Fabric and pdsh get in.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import fabric
import paramiko
import pytest

if TYPE_CHECKING:  # a runtime `import conftest` could pick up another folder's conftest.py
    from conftest import SshHosts

pytestmark = pytest.mark.ssh


def test_each_host_is_reachable_and_has_its_own_name_and_address(ssh_hosts: SshHosts) -> None:
    addresses = {address for _, address in ssh_hosts.hosts}
    for name, address in ssh_hosts.hosts:
        result = ssh_hosts.run(name, "hostname; ip -o -4 addr show")
        assert result.returncode == 0, result.stderr
        hostname, *addr_lines = result.stdout.splitlines()
        assert hostname == name
        own = {line.split()[3].split("/")[0] for line in addr_lines if " lo " not in line}
        assert own == {address}, f"{name} has {own}; other hosts' addresses: {addresses - own}"


def test_hosts_reach_each_other_by_name(ssh_hosts: SshHosts) -> None:
    # Host to host, not only controller to host: the first node ssh-es into the last one.
    (first, _), (last, last_address) = ssh_hosts.hosts[0], ssh_hosts.hosts[-1]
    inner = f"getent ahostsv4 {last} | head -n 1; ssh -F {shlex.quote(str(ssh_hosts.ssh_config))}"
    result = ssh_hosts.run(first, f"{inner} {last} hostname")
    assert result.returncode == 0, result.stderr
    resolved, hostname = result.stdout.splitlines()
    assert resolved.split()[0] == last_address
    assert hostname == last


def test_nothing_leaves_the_test_network(ssh_hosts: SshHosts) -> None:
    # No default route inside a host; the range has an `unreachable` route in the root namespace.
    result = ssh_hosts.run(ssh_hosts.hosts[0][0], "ip route get 1.1.1.1")
    assert result.returncode != 0
    assert "unreachable" in result.stderr.lower()
    prefix = ssh_hosts.hosts[0][1].rsplit(".", 1)[0]
    routes = subprocess.run(
        ["ip", "route", "show", "type", "unreachable"], capture_output=True, text=True, check=True
    )
    assert f"unreachable {prefix}.0/24" in routes.stdout


def test_host_key_checking_is_enforced(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    (h1, h1_address), (h2, _) = ssh_hosts.hosts[0], ssh_hosts.hosts[1]
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    strict = ("-o", "StrictHostKeyChecking=yes")

    # Refused with the option given explicitly, and by the written ssh_config on its own.
    for options in (strict, ()):
        unknown = ssh_hosts.run(h1, "true", "-o", f"UserKnownHostsFile={empty}", *options)
        assert unknown.returncode == 255
        assert "Host key verification failed" in unknown.stderr

    # h2's key recorded under h1's names: a host that is not who it claims to be.
    h2_key = next(
        line.split(None, 1)[1]
        for line in ssh_hosts.known_hosts.read_text().splitlines()
        if line.split(",")[0] == h2
    )
    forged = tmp_path / "forged_known_hosts"
    forged.write_text(f"{h1},{h1_address} {h2_key}\n")
    spoofed = ssh_hosts.run(h1, "true", "-o", f"UserKnownHostsFile={forged}", *strict)
    assert spoofed.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in spoofed.stderr

    assert ssh_hosts.run(h1, "true", *strict).returncode == 0


def _fabric_connection(ssh_hosts: SshHosts, host: str, known_hosts: Path) -> fabric.Connection:
    # Fabric sets paramiko's AutoAddPolicy and reads no known_hosts file, ssh_config's
    # UserKnownHostsFile included: host keys are only checked when the caller loads them.
    config = fabric.Config(runtime_ssh_path=str(ssh_hosts.ssh_config))
    connection = fabric.Connection(
        host, config=config, connect_kwargs={"key_filename": str(ssh_hosts.key)}
    )
    connection.client.load_host_keys(str(known_hosts))
    connection.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return connection


def test_fabric_connection_runs_a_command(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    name, address = ssh_hosts.hosts[1]
    with _fabric_connection(ssh_hosts, name, ssh_hosts.known_hosts) as connection:
        assert connection.host == address  # HostName came from the ssh_config
        result = connection.run(
            "hostname; echo err >&2; exit 3", hide=True, warn=True, in_stream=False
        )
    assert (result.stdout, result.stderr, result.exited) == (f"{name}\n", "err\n", 3)

    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    refused = _fabric_connection(ssh_hosts, name, empty)
    try:
        with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
            refused.run("true", hide=True, in_stream=False)
    finally:
        # paramiko keeps the half-open transport after refusing a host key, and fabric's close()
        # skips it (it never counted as connected): close the client itself.
        refused.client.close()


def test_pdsh_fans_out_through_the_ssh_config(ssh_hosts: SshHosts) -> None:
    names = [name for name, _ in ssh_hosts.hosts]
    env = {"PATH": "/usr/sbin:/usr/bin:/bin", "PDSH_SSH_ARGS_APPEND": f"-F {ssh_hosts.ssh_config}"}
    result = subprocess.run(
        ["pdsh", "-S", "-R", "ssh", "-w", ",".join(names), "hostname"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == sorted(f"{n}: {n}" for n in names)


@pytest.mark.timeout(120)
def test_up_again_changes_nothing(ssh_hosts: SshHosts) -> None:
    known_hosts = ssh_hosts.known_hosts.read_text()
    pids = [ssh_hosts.sshd_pid(name) for name, _ in ssh_hosts.hosts]
    again = subprocess.run(
        ["bash", str(ssh_hosts.script), "up", str(len(ssh_hosts.hosts))],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert ssh_hosts.known_hosts.read_text() == known_hosts
    assert [ssh_hosts.sshd_pid(name) for name, _ in ssh_hosts.hosts] == pids
    assert ssh_hosts.run(ssh_hosts.hosts[-1][0], "true").returncode == 0


WORKER = """\
import datetime, json, os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(json.dumps({
    "rank": dist.get_rank(), "world_size": dist.get_world_size(),
    "local_rank": int(os.environ["LOCAL_RANK"]), "host": socket.gethostname(),
    "sum": value.item(), "ifname": os.environ["GLOO_SOCKET_IFNAME"],
}))
dist.destroy_process_group()
"""


def _interface_towards(ssh_hosts: SshHosts, host: str, address: str) -> str:
    """The interface on `host` that carries `address`.

    `ip route get` names it, except on the host that owns the address: there the answer is
    `local ... dev lo`, and gloo bound to lo would advertise 127.0.0.1 to its peers.
    """
    result = ssh_hosts.run(host, f"ip -o route get {address}; ip -o -4 addr show to {address}/32")
    assert result.returncode == 0, result.stderr
    route, *owner = result.stdout.splitlines()
    if route.startswith("local"):
        return owner[0].split()[1]
    words = route.split()
    return words[words.index("dev") + 1]


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_gloo_all_reduce_across_two_hosts(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    worker = tmp_path / "all_reduce.py"  # the filesystem is shared: every host sees this file
    worker.write_text(WORKER)
    (master, master_addr), (other, _) = ssh_hosts.hosts[0], ssh_hosts.hosts[1]
    # The master port must be free in the master's own port space, so ask the master.
    port = ssh_hosts.run(
        master,
        f"{shlex.quote(sys.executable)} -c "
        + shlex.quote(
            "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        ),
    )
    assert port.returncode == 0, port.stderr
    master_port = int(port.stdout)
    tag = f"orchestrate-test-{uuid.uuid4().hex}"

    procs: list[tuple[str, subprocess.Popen[str]]] = []
    try:
        for node_rank, host in enumerate([master, other]):
            ifname = _interface_towards(ssh_hosts, host, master_addr)
            for local_rank in range(2):
                env = {
                    "ORCHESTRATE_TEST_TAG": tag,
                    "RANK": str(node_rank * 2 + local_rank),
                    "LOCAL_RANK": str(local_rank),
                    "WORLD_SIZE": "4",
                    "LOCAL_WORLD_SIZE": "2",
                    "GROUP_RANK": str(node_rank),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "GLOO_SOCKET_IFNAME": ifname,
                }
                assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
                command = (
                    f"env {assignments} {shlex.quote(sys.executable)} {shlex.quote(str(worker))}"
                )
                proc = subprocess.Popen(
                    ssh_hosts.ssh_argv(host, command),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                procs.append((host, proc))
        outputs = [(host, *proc.communicate(timeout=150), proc.returncode) for host, proc in procs]
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    reports = []
    for host, stdout, stderr, returncode in outputs:
        assert returncode == 0, f"{host}: exit {returncode}\n{stderr[-3000:]}"
        report = json.loads(stdout.strip().splitlines()[-1])
        assert report["host"] == host
        assert report["ifname"] == "eth0"
        reports.append(report)
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    assert {r["world_size"] for r in reports} == {4}
    assert {r["sum"] for r in reports} == {1.0 + 2.0 + 3.0 + 4.0}
