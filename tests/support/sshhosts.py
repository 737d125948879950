"""Real SSH test hosts: their bring-up, the processes on them, and cleaning up after a test.

`tests/clusters/sshhosts.sh up 3` starts three hosts, each in its own network, PID, UTS and mount
namespace with its own address, process table, hostname and sshd on :22; the session ends with
`sshhosts.sh down`. Nothing here is mocked: a test that passes has talked to a real sshd over a
real (virtual) network.

A host sees and signals only its own processes, as a real machine does; this process (the root
namespace) still sees all of them, under root-namespace pids. Pids that orchestrate reports
(`status` ranks, leases) are the hosts' own: `SshHosts.root_pid` translates one for a check
from here, and `tagged_by_namespace` says on which host each process of a job lives.

Without root, or when the hosts cannot start, the tests fail loudly instead of skipping: a
skipped SSH suite looks green while proving nothing. Deselect with `-m "not ssh"` on purpose.

The fixtures that use this (``ssh_hosts``, ``no_stray_remote_processes``) are in
tests/conftest.py: the SSH tests, the backend contract test and the frameworks' tests share them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "clusters" / "sshhosts.sh"
DEFAULT_STATE_DIR = Path("/tmp/orchestrate-sshhosts")
UP_TIMEOUT_S = 600  # a fresh machine installs openssh-server first
DOWN_TIMEOUT_S = 120


@dataclass(frozen=True)
class SshHosts:
    """The running hosts and the client files that reach them (all written by sshhosts.sh)."""

    state_dir: Path
    ssh_config: Path
    known_hosts: Path
    key: Path
    hosts: list[tuple[str, str]]  # (name, IPv4 address), h1 first
    script: Path = SCRIPT

    def ssh_argv(self, host: str, command: str, *options: str) -> list[str]:
        """The argv of `ssh -F ssh_config [options] host command`, as a user would type it."""
        return ["ssh", "-F", str(self.ssh_config), *options, host, command]

    def run(
        self, host: str, command: str, *options: str, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Runs `command` on `host` over ssh; no stdin, output captured, never raises on exit."""
        return subprocess.run(
            self.ssh_argv(host, command, *options),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def sshd_pid(self, host: str) -> int:
        """The root-namespace pid of the listening sshd of `host` (recorded by sshhosts.sh)."""
        return int((self.state_dir / host / "sshd.pid").read_text().strip())

    def init_pid(self, host: str) -> int:
        """The root-namespace pid of `host`'s PID 1: ending it ends the host."""
        return int((self.state_dir / host / "init.pid").read_text().strip())

    def pid_namespace(self, host: str) -> str:
        """`host`'s PID namespace (as `readlink /proc/PID/ns/pid` names it)."""
        return os.readlink(f"/proc/{self.init_pid(host)}/ns/pid")

    def host_of(self, pid: int) -> str | None:
        """The host a root-namespace pid runs on; None for this machine or a gone process."""
        namespace = _ns(pid, "pid")
        return next((name for name, _ in self.hosts if self.pid_namespace(name) == namespace),
                    None)

    def root_pid(self, host: str, pid: int) -> int:
        """The root-namespace pid of the process that is `pid` on `host` (a pid that a host
        reported, such as a rank's in `orchestrate status`); raises if there is none."""
        namespace = self.pid_namespace(host)
        for proc in _processes():
            if proc.pid_ns == namespace and proc.host_pid == pid:
                return proc.pid
        raise LookupError(f"no process {pid} on {host}")


def _script(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def _read_hosts(state_dir: Path) -> list[tuple[str, str]]:
    hosts = []
    for line in (state_dir / "hosts.txt").read_text().splitlines():
        name, address = line.split()
        hosts.append((name, address))
    return hosts


@dataclass(frozen=True)
class _Proc:
    """A live process as the root namespace sees it."""

    pid: int  # in the root namespace
    host_pid: int  # in its own (innermost) PID namespace
    pid_ns: str
    net_ns: str | None


def _ns(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _processes() -> list[_Proc]:
    """Every live (not zombie) process on the machine, from one /proc scan."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(int(entry.name)):
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines()
                      if line.startswith("NSpid:")), [entry.name])
        pid_ns = _ns(entry.name, "pid")
        if pid_ns is None:
            continue
        found.append(_Proc(int(entry.name), int(nspid[-1]), pid_ns, _ns(entry.name, "net")))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _leftovers_after_down(
    state_dir: Path, daemons: dict[str, int], pid_namespaces: set[str]
) -> list[str]:
    """What `down` should have removed but did not; empty when the machine is clean."""
    problems = [f"{what} pid {pid} still runs" for what, pid in daemons.items() if alive(pid)]
    problems += [
        f"pid {proc.pid} still runs in a test host's PID namespace"
        for proc in _processes()
        if proc.pid_ns in pid_namespaces
    ]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    problems += [
        f"network namespace {line.split()[0]} remains"
        for line in netns.stdout.splitlines()
        if line.startswith("orch-h")
    ]
    if "# orchestrate-sshhosts" in Path("/etc/hosts").read_text():
        problems.append("/etc/hosts still has orchestrate-sshhosts lines")
    if state_dir.exists():
        problems.append(f"{state_dir} remains")
    return problems


def hosts_up() -> Iterator[SshHosts]:
    """Three real SSH hosts h1..h3 for the whole session; torn down and checked clean at the end.

    The body of the session fixture ``ssh_hosts`` (tests/conftest.py), one bring-up per session
    for every test that talks to the hosts.
    """
    if os.geteuid() != 0:
        pytest.fail(
            f"the SSH test hosts need root (network namespaces, /etc/hosts): run as root, or "
            f'deselect these tests with -m "not ssh" (script: {SCRIPT})'
        )
    env = dict(os.environ)
    state_dir = Path(env.get("ORCHESTRATE_SSH_DIR", str(DEFAULT_STATE_DIR)))
    up = _script("up", "3", env=env, timeout=UP_TIMEOUT_S)
    if up.returncode != 0:
        down = _script("down", env=env, timeout=DOWN_TIMEOUT_S)
        pytest.fail(
            f"{SCRIPT} up 3 failed with exit {up.returncode}:\n{up.stderr[-4000:]}\n"
            f"(down after the failure: exit {down.returncode} {down.stderr[-1000:]})"
        )
    hosts = SshHosts(
        state_dir=state_dir,
        ssh_config=state_dir / "ssh_config",
        known_hosts=state_dir / "known_hosts",
        key=state_dir / "id_ed25519",
        hosts=_read_hosts(state_dir),
    )
    try:
        yield hosts
    finally:
        daemons, namespaces = {}, set()
        for name, _ in hosts.hosts:
            with contextlib.suppress(OSError, ValueError):
                daemons[f"{name} init"] = hosts.init_pid(name)
                daemons[f"{name} sshd"] = hosts.sshd_pid(name)
                namespaces.add(hosts.pid_namespace(name))
        down = _script("down", env=env, timeout=DOWN_TIMEOUT_S)
        problems = _leftovers_after_down(state_dir, daemons, namespaces)
        if down.returncode != 0 or problems:
            pytest.fail(
                f"{SCRIPT} down: exit {down.returncode}; left behind: {problems}\n"
                f"{down.stderr[-2000:]}"
            )


def _strays(hosts: SshHosts) -> list[int]:
    """Root-namespace pids of what runs on the hosts besides their init and sshd listener:
    processes in a host's PID namespace, and processes a test started in a host's network
    namespace with `ip netns exec` (those stay in the root PID namespace)."""
    keep: set[int] = set()
    pid_namespaces: set[str] = set()
    net_namespaces: set[str] = set()
    for name, _ in hosts.hosts:
        init = hosts.init_pid(name)
        keep |= {init, hosts.sshd_pid(name), _parent(init)}  # _parent: its `unshare`
        pid_namespaces.add(hosts.pid_namespace(name))
        net = _ns(init, "net")
        if net is not None:
            net_namespaces.add(net)
    return [
        proc.pid
        for proc in _processes()
        if proc.pid not in keep
        and (proc.pid_ns in pid_namespaces or proc.net_ns in net_namespaces)
    ]


def _parent(pid: int) -> int:
    """The parent of a root-namespace pid, as a root-namespace pid."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)



def end_strays(hosts: SshHosts) -> None:
    """After a test, leave nothing but the sshd listeners running on the hosts (the body of the
    fixture ``no_stray_remote_processes``).

    Sessions that are closing get a moment to go by themselves; the rest get SIGTERM (+SIGCONT
    for stopped ones), then SIGKILL, sent from here (the root namespace sees every host).
    """
    deadline = time.monotonic() + 2
    while (strays := _strays(hosts)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not strays:
        return
    _signal_all(strays, signal.SIGTERM)
    _signal_all(strays, signal.SIGCONT)
    deadline = time.monotonic() + 3
    while (strays := _strays(hosts)) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_all(strays, signal.SIGKILL)


def tagged_on(
    hosts: SshHosts, job_id: str, names: Iterable[str] | None = None
) -> dict[str, list[int]]:
    """Pids carrying the job's tag, asked on each host (or each of `names`) over ssh, what a
    user would run; each host answers with its own pids and sees only its own processes."""
    script = (
        "for p in /proc/[0-9]*; do "
        f"grep -qzx 'ORCHESTRATE_JOB_ID={job_id}' $p/environ 2>/dev/null && echo ${{p#/proc/}}; "
        "done; true"
    )
    found = {}
    for name in [name for name, _ in hosts.hosts] if names is None else names:
        result = hosts.run(name, script)
        assert result.returncode == 0, result.stderr
        found[name] = [int(pid) for pid in result.stdout.split()]
    return {name: pids for name, pids in found.items() if pids}


def tagged_by_namespace(hosts: SshHosts, job_id: str) -> dict[str, list[int]]:
    """Root-namespace pids carrying the job's tag, by the host whose PID namespace holds them:
    the check from outside, which no host's view of itself can fool. Processes outside the
    hosts are left out on purpose: other test sessions on this machine may run a job with the
    same id (the SSH backend starts nothing tagged on the controller)."""
    needle = f"ORCHESTRATE_JOB_ID={job_id}".encode()
    hosts_by_ns = {}
    for name, _ in hosts.hosts:
        with contextlib.suppress(OSError):  # a host that is down has no processes
            hosts_by_ns[hosts.pid_namespace(name)] = name
    found: dict[str, list[int]] = {}
    for proc in _processes():
        host = hosts_by_ns.get(proc.pid_ns)
        if host is None:
            continue
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.setdefault(host, []).append(proc.pid)
    return found


def stop_tagged(hosts: SshHosts, job_id: str, grace_s: float) -> dict[str, int]:
    """Stops every process of the job on the test hosts, from the root namespace (SIGTERM and
    SIGCONT, SIGKILL after ``grace_s``); returns how many each host had. Test cleanup only: the
    backend's own stopping goes through each host. Never touches processes outside the hosts
    (a root-namespace kill-by-tag could hit another session's job of the same id)."""
    found = tagged_by_namespace(hosts, job_id)
    pids = [pid for group in found.values() for pid in group]
    _signal_all(pids, signal.SIGTERM)
    _signal_all(pids, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while (left := tagged_by_namespace(hosts, job_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all([pid for group in left.values() for pid in group], signal.SIGKILL)
    return {host: len(group) for host, group in found.items()}


def agents_on(hosts: SshHosts) -> dict[str, set[int]]:
    """Root-namespace pids of the SSH agents serving on each host (``python -S -c <agent>
    serve``, one per rank and spare), by the host whose PID namespace holds them."""
    hosts_by_ns = {}
    for name, _ in hosts.hosts:
        with contextlib.suppress(OSError):  # a host that is down has no processes
            hosts_by_ns[hosts.pid_namespace(name)] = name
    found: dict[str, set[int]] = {name: set() for name in hosts_by_ns.values()}
    for proc in _processes():
        host = hosts_by_ns.get(proc.pid_ns)
        if host is None:
            continue
        try:
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if argv[1:3] == [b"-S", b"-c"] and argv[-1:] == [b"serve"]:
            found[host].add(proc.pid)
    return found
