"""What the SSH-path tests add to the test hosts (tests/support/sshhosts.py): an ssh_config a
newcomer would write (aliases, a jump host), a known_hosts file with one key changed, and a
second sshd on a host with its own sshd_config (a small ``MaxSessions``), stopped after the test.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.sshhosts import SshHosts, alive

#: A port no test host's own sshd uses.
EXTRA_PORT = 2222


def client_config(hosts: SshHosts, path: Path, entries: dict[str, str],
                  known_hosts: Path | None = None) -> Path:
    """An ssh_config of ``entries`` (alias -> its lines, e.g. ``HostName 198.18.8.11``), each
    logging in as the test hosts' root with their key, host keys checked against
    ``known_hosts`` (default: the hosts' own file)."""
    blocks = [f"Host {alias}\n" + "".join(f"    {line}\n" for line in lines.splitlines())
              for alias, lines in entries.items()]
    blocks.append(
        "Host *\n    User root\n"
        f'    IdentityFile "{hosts.key}"\n    IdentitiesOnly yes\n'
        f'    UserKnownHostsFile "{known_hosts or hosts.known_hosts}"\n'
        "    GlobalKnownHostsFile /dev/null\n    StrictHostKeyChecking yes\n"
        "    BatchMode yes\n    ConnectTimeout 5\n    LogLevel ERROR\n")
    path.write_text("\n".join(blocks))
    return path


def known_hosts_with(hosts: SshHosts, path: Path, *, changed: str | None = None,
                     dropped: str | None = None, extra: str | None = None) -> Path:
    """The hosts' known_hosts, with host ``changed``'s key replaced by another host's (what a
    reinstalled or impersonated machine shows), host ``dropped`` left out, and ``extra`` (a
    ``[address]:port`` pattern) given h1's key."""
    lines = hosts.known_hosts.read_text().splitlines()
    keys = {line.split(",")[0]: line.split(" ", 1)[1] for line in lines if line.strip()}
    out = []
    for line in lines:
        name = line.split(",")[0]
        if name == dropped:
            continue
        if name == changed:
            other = next(k for n, k in keys.items() if n != changed)
            line = f"{line.split(' ', 1)[0]} {other}"
        out.append(line)
    if extra is not None:
        out.append(f"{extra} {keys['h1']}")
    path.write_text("\n".join(out) + "\n")
    return path


@contextlib.contextmanager
def extra_sshd(hosts: SshHosts, host: str, folder: Path, **settings: str) -> Iterator[int]:
    """A second sshd in ``host``'s network namespace on :data:`EXTRA_PORT`: the host's own
    sshd_config with ``settings`` (e.g. ``MaxSessions="2"``) in place of its lines; the port.
    It runs in the root PID namespace (``ip netns exec``), and is stopped when the block ends."""
    own = (hosts.state_dir / host / "sshd_config").read_text().splitlines()
    settings = {"Port": str(EXTRA_PORT), "PidFile": str(folder / "extra-sshd.pid"), **settings}
    lines = [line for line in own if line.split(" ", 1)[0] not in settings]
    lines += [f"{key} {value}" for key, value in settings.items()]
    config = folder / "extra_sshd_config"
    config.write_text("\n".join(lines) + "\n")
    log = folder / "extra-sshd.log"
    proc = subprocess.Popen(["ip", "netns", "exec", f"orch-{host}", "/usr/sbin/sshd", "-D",
                             "-f", str(config), "-E", str(log)], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while "Server listening" not in (log.read_text() if log.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the extra sshd on {host} did not start: "
                                     f"{log.read_text() if log.exists() else 'no log'}")
            time.sleep(0.05)
        yield EXTRA_PORT
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert not alive(proc.pid)
