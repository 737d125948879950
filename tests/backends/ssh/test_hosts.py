"""The SSH test hosts behave like separate machines: what orchestrate's SSH backend relies on.

Each check is one a user would make on a real cluster: can I log in, is this the machine I think
it is, is the host key checked, does DDP across two machines add up, do Fabric and pdsh get in,
can a process on one machine see or kill another machine's processes (it must not).
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fabric
import paramiko
import pytest

from tests.support.sshhosts import SshHosts, alive

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


def _up_again(ssh_hosts: SshHosts) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ssh_hosts.script), "up", str(len(ssh_hosts.hosts))],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


@pytest.mark.timeout(120)
def test_up_again_changes_nothing(ssh_hosts: SshHosts) -> None:
    known_hosts = ssh_hosts.known_hosts.read_text()
    daemons = [(ssh_hosts.init_pid(name), ssh_hosts.sshd_pid(name)) for name, _ in ssh_hosts.hosts]
    again = _up_again(ssh_hosts)
    assert again.returncode == 0, again.stderr
    assert ssh_hosts.known_hosts.read_text() == known_hosts
    assert [
        (ssh_hosts.init_pid(name), ssh_hosts.sshd_pid(name)) for name, _ in ssh_hosts.hosts
    ] == daemons
    assert ssh_hosts.run(ssh_hosts.hosts[-1][0], "true").returncode == 0


def _on_host_by_tag(ssh_hosts: SshHosts, host: str, tag: str, action: str = "") -> list[int]:
    """Pids on `host` whose environment has TEST_TAG=tag, found by a /proc scan run on the host
    (kill-by-tag as the backend's agent does it); `action` (e.g. "kill -TERM") is applied to
    each."""
    then = f" && {action} ${{p#/proc/}}" if action else ""
    script = (
        "for p in /proc/[0-9]*; do "
        f"grep -qzx 'TEST_TAG={tag}' $p/environ 2>/dev/null && echo ${{p#/proc/}}{then}; "
        "done; true"
    )
    result = ssh_hosts.run(host, script)
    assert result.returncode == 0, result.stderr
    return [int(pid) for pid in result.stdout.split()]


def _start_tagged_sleep(ssh_hosts: SshHosts, host: str, tag: str) -> int:
    """`sleep 300` on `host`, outliving the ssh session, tagged TEST_TAG=tag; its pid there."""
    result = ssh_hosts.run(
        host, f"TEST_TAG={tag} setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!"
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def _wait_gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(60)
def test_each_host_sees_and_kills_only_its_own_processes(ssh_hosts: SshHosts) -> None:
    (h1, _), (h2, _) = ssh_hosts.hosts[0], ssh_hosts.hosts[1]
    tag = uuid.uuid4().hex
    pid_on_h2 = _start_tagged_sleep(ssh_hosts, h2, tag)
    assert _on_host_by_tag(ssh_hosts, h2, tag) == [pid_on_h2]
    # Kill-by-tag on h1 finds nothing, and h2's process lives on.
    assert _on_host_by_tag(ssh_hosts, h1, tag, "kill -TERM") == []
    assert _on_host_by_tag(ssh_hosts, h2, tag) == [pid_on_h2]
    # This machine sees it too, under its own pid, in h2's PID namespace and no other.
    root_pid = ssh_hosts.root_pid(h2, pid_on_h2)
    assert ssh_hosts.host_of(root_pid) == h2
    assert b"TEST_TAG=" + tag.encode() in Path(f"/proc/{root_pid}/environ").read_bytes()
    assert os.readlink(f"/proc/{root_pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    # Kill-by-tag on its own host ends it.
    assert _on_host_by_tag(ssh_hosts, h2, tag, "kill -TERM") == [pid_on_h2]
    assert _wait_gone(root_pid)


@pytest.mark.timeout(60)
def test_each_host_has_an_init_that_reaps_orphans(ssh_hosts: SshHosts) -> None:
    for name, _ in ssh_hosts.hosts:
        # The sleep's parent shell exits at once: the orphan goes to the host's PID 1.
        result = ssh_hosts.run(name, "tr '\\0' ' ' </proc/1/cmdline; echo; (sleep 0.2 & echo $!)")
        assert result.returncode == 0, result.stderr
        init_cmdline, orphan = result.stdout.splitlines()
        assert f"host-init.sh {name} " in init_cmdline
        assert ssh_hosts.root_pid(name, 1) == ssh_hosts.init_pid(name)
        time.sleep(0.6)
        # Reaped: not even a zombie left on the host.
        left = ssh_hosts.run(name, f"cat /proc/{orphan}/stat 2>/dev/null; true")
        assert left.stdout == "", f"{name}: orphan {orphan} not reaped: {left.stdout}"


def test_root_bashrc_is_blank_on_the_hosts_only(ssh_hosts: SshHosts) -> None:
    bashrc = Path(pwd.getpwnam("root").pw_dir) / ".bashrc"
    mounted = f" {bashrc} "
    assert mounted not in Path("/proc/self/mountinfo").read_text()  # the machine's: untouched
    for name, _ in ssh_hosts.hosts:
        result = ssh_hosts.run(name, f"cat {bashrc}; echo ---; cat /proc/self/mountinfo")
        content, _, mountinfo = result.stdout.partition("---\n")
        if bashrc.exists():
            assert result.returncode == 0, result.stderr
            assert content == "", f"{name} runs root's ~/.bashrc"
            assert mounted in mountinfo
        else:  # nothing to hide, and nothing was created
            assert "No such file" in result.stderr


@pytest.mark.timeout(120)
def test_a_host_goes_down_whole_and_up_brings_only_it_back(ssh_hosts: SshHosts) -> None:
    *others, (last, _) = ssh_hosts.hosts
    known_hosts = ssh_hosts.known_hosts.read_text()
    kept = [(ssh_hosts.init_pid(name), ssh_hosts.sshd_pid(name)) for name, _ in others]
    init, sshd = ssh_hosts.init_pid(last), ssh_hosts.sshd_pid(last)
    session = ssh_hosts.root_pid(last, _start_tagged_sleep(ssh_hosts, last, uuid.uuid4().hex))

    os.kill(init, signal.SIGTERM)  # what `down` does: the kernel ends the whole PID namespace
    assert all(_wait_gone(pid) for pid in (init, sshd, session))
    assert ssh_hosts.run(last, "true", "-o", "ConnectTimeout=2").returncode == 255

    again = _up_again(ssh_hosts)
    assert again.returncode == 0, again.stderr
    assert ssh_hosts.init_pid(last) not in (init, sshd)
    assert ssh_hosts.run(last, "hostname").stdout == f"{last}\n"
    assert ssh_hosts.known_hosts.read_text() == known_hosts
    assert [(ssh_hosts.init_pid(name), ssh_hosts.sshd_pid(name)) for name, _ in others] == kept


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
