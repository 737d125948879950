"""Reaching SSH hosts: who each host is, connections with host keys checked, bounded fan-out.

The only module that touches Fabric and paramiko (they have no type hints): the rest of the
backend sees :class:`Target`, :class:`Link`, :class:`SshChannel` and :class:`PerHost`.

Connections follow ``~/.ssh/config`` (or the inventory's ``ssh.config_file``, which then
replaces it) for HostName, User, Port and IdentityFile; the inventory's own ``ssh`` settings win
over it. Host keys are always checked: Fabric checks none by default, so the known_hosts files
(inventory ``known_hosts_file``, else ssh_config's ``UserKnownHostsFile``, else
``~/.ssh/known_hosts``) are loaded here and an unknown key is refused, unless the inventory says
``accept_unknown_host_keys: true`` (then it is trusted for this connection, never saved). A
changed key is refused either way, and jump hosts (``ProxyJump``) are checked by the same
rules (:mod:`.hostkeys`). There are no passwords: keys and the SSH agent only.

Sessions per connection stay within what the host's sshd allows: at most
:data:`SESSIONS_PER_CONNECTION`, and fewer once the host refused one (``MaxSessions``), each
further one then on a new connection; a host that takes none is named as such.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from orchestrate.backends.ssh.hostkeys import (
    ConnectError as ConnectError,  # re-exported: where the backend has always found it
)
from orchestrate.backends.ssh.hostkeys import (
    gateways,
    open_verified,
    verify_chain,
)

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Plan
    from orchestrate.core.spec.inventory import Inventory, SSHSpec

T = TypeVar("T")

#: Sessions opened on one connection before another is made (sshd's MaxSessions is 10).
SESSIONS_PER_CONNECTION = 8
#: A keepalive goes to every host this often, so there is always data in flight ...
KEEPALIVE_S = 5
#: ... and a host that acknowledges none of it for this long is lost (TCP_USER_TIMEOUT): its
#: connection fails and every channel on it ends, so a host cut off from the network is named
#: within about this long (plus a keepalive), whether its ranks are in a collective or not.
DEAD_PEER_S = 15


@dataclass(frozen=True)
class Target:
    """One host to reach: its inventory node and how to log in (no secrets here)."""

    name: str
    address: str
    python: str
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    known_hosts_file: str | None = None
    accept_unknown_host_keys: bool = False
    connect_timeout_s: float = 10.0
    lease_dir: str | None = None  # the host's shared lease book (None: its default)

    @property
    def label(self) -> str:
        """``h1`` or ``gpu01 (10.0.0.5)``."""
        return self.name if self.address == self.name else f"{self.name} ({self.address})"

    def to_json(self) -> dict[str, Any]:
        """For the run directory, so ``cancel`` can reach the hosts later."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Target:
        """The inverse of :meth:`to_json`."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def target(name: str, address: str, python: str, ssh: SSHSpec | None,
           connect_timeout_s: float, lease_dir: str | None = None) -> Target:
    """How to reach one host from its ssh settings (an inventory node's, or the command line's
    for ``inventory probe HOST``): the settings' connect timeout over ``connect_timeout_s``."""
    return Target(
        name=name,
        address=address,
        python=python,
        user=ssh.user if ssh else None,
        port=ssh.port if ssh else None,
        identity_file=ssh.identity_file if ssh else None,
        config_file=ssh.config_file if ssh else None,
        known_hosts_file=ssh.known_hosts_file if ssh else None,
        accept_unknown_host_keys=bool(ssh and ssh.accept_unknown_host_keys),
        connect_timeout_s=(ssh.connect_timeout_s if ssh and ssh.connect_timeout_s
                           else connect_timeout_s),
        lease_dir=lease_dir,
    )


def targets_for(plan: Plan, inventory: Inventory, connect_timeout_s: float) -> dict[str, Target]:
    """How to reach each node of the plan (inventory ssh settings over the job's defaults)."""
    targets = {}
    for node in plan.nodes:
        spec = inventory.node(node.name)
        targets[node.name] = target(node.name, node.address, node.python,
                                    spec.ssh if spec is not None else None, connect_timeout_s,
                                    spec.lease_dir if spec is not None else None)
    return targets


class SshChannel(Protocol):
    """The part of paramiko's Channel the backend uses."""

    closed: bool

    def get_pty(self, term: str, width: int, height: int) -> None: ...
    def exec_command(self, command: str) -> None: ...
    def set_combine_stderr(self, combine: bool) -> bool: ...
    def settimeout(self, timeout: float | None) -> None: ...
    def recv(self, nbytes: int) -> bytes: ...
    def sendall(self, data: bytes) -> None: ...
    def exit_status_ready(self) -> bool: ...
    def recv_exit_status(self) -> int: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class RunResult:
    """A finished remote command (stderr merged into stdout)."""

    code: int
    output: str


@dataclass(frozen=True)
class PerHost(Generic[T]):
    """What one host gave: a value, or the error that stopped it (partial failure is data)."""

    value: T | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        """Whether the host gave a value."""
        return self.error is None


def fan_out(
    targets: Sequence[Target], work: Callable[[Target], T], fanout: int
) -> dict[str, PerHost[T]]:
    """Run ``work`` for every target, at most ``fanout`` at once; a result or error per host.

    ``work`` must bound its own waits (connect timeout, reply deadlines): nothing here waits
    for ever on one host.
    """
    results: dict[str, PerHost[T]] = {}
    if not targets:
        return results
    with ThreadPoolExecutor(max_workers=max(1, min(fanout, len(targets)))) as pool:
        futures = [(t, pool.submit(work, t)) for t in targets]
        for target, future in futures:
            try:
                results[target.name] = PerHost(value=future.result())
            except Exception as exc:  # every failure becomes that host's data
                results[target.name] = PerHost(error=exc)
    return results


def preload() -> None:
    """Import Fabric and paramiko now (a few hundred ms on a busy machine): the supervisor does
    it before anything else, so the logins start as early as they can."""
    import fabric  # noqa: F401
    import paramiko  # noqa: F401


@lru_cache(maxsize=16)
def _config(config_file: str | None) -> Any:
    import fabric

    if config_file is None:
        return fabric.Config()  # reads ~/.ssh/config and /etc/ssh/ssh_config
    return fabric.Config(runtime_ssh_path=os.path.expanduser(config_file))


def _check_files(t: Target) -> None:
    """The files the inventory names must exist (else the login fails for a reason it hides);
    and the ``[ssh]`` extra must be installed (else every host fails with an import error)."""
    try:
        import fabric  # noqa: F401
        import paramiko  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ConnectError("ssh", f"SSH needs the [ssh] extra ({exc.name} is not installed): "
                                  "pip install 'orchestrate[ssh]'") from None
    if t.config_file and not os.path.isfile(os.path.expanduser(t.config_file)):
        raise ConnectError("ssh", f"ssh config file {t.config_file} not found "
                                  "(inventory ssh.config_file)")
    if t.identity_file and not os.path.isfile(os.path.expanduser(t.identity_file)):
        raise ConnectError("login", f"identity file {t.identity_file} not found "
                                    "(inventory ssh.identity_file)")


def _connection(t: Target) -> Any:
    """A Fabric connection to ``t``, not yet open: ssh_config, then the inventory's settings."""
    import fabric

    timeout = t.connect_timeout_s
    # A Connection writes into its Config (fabric sets ``inline_ssh_env`` through it, and
    # each write re-merges the whole Config): a Config shared by connections opened in
    # parallel is read half-merged by the others ("No attribute or config key found for
    # 'port'"). Each gets its own copy of the parsed ssh_config's Config.
    config = _config(t.config_file).clone()
    kwargs: dict[str, Any] = {
        "banner_timeout": timeout,
        "auth_timeout": timeout,
        "channel_timeout": timeout,
    }
    conn = fabric.Connection(
        t.address, user=t.user, port=t.port, config=config,
        connect_timeout=max(1, math.ceil(timeout)), connect_kwargs=kwargs,
    )
    if t.identity_file:
        others = list(conn.connect_kwargs.get("key_filename", []))
        conn.connect_kwargs["key_filename"] = [os.path.expanduser(t.identity_file), *others]
    if str(conn.ssh_config.get("identitiesonly", "no")).lower() == "yes":
        conn.connect_kwargs["look_for_keys"] = False
    verify_chain(conn, t, kwargs)
    return conn


class Link:
    """The SSH connection(s) to one host; more open as sessions fill up (sshd's MaxSessions)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        # (fabric Connection, sessions open or being opened on it)
        self._connections: list[tuple[Any, int]] = []
        # The session channels opened on each connection (by id), so that those closed since
        # (an attempt's agents that ended) make room again: a restart that keeps the link
        # opens its sessions on the same connection, without logging in again.
        self._opened: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self._lost: str | None = None
        self.hostname: str | None = None  # what the host calls itself, once known
        self._per_connection = SESSIONS_PER_CONNECTION
        #: Sessions the host's sshd took on one connection before refusing one (MaxSessions),
        #: once it refused one.
        self.max_sessions: int | None = None

    def open(self) -> None:
        """Connect and log in; raises :class:`ConnectError` saying what failed."""
        with self._lock:
            if not self._connections:
                self._connections.append((self._connect(), 0))

    def _connect(self) -> Any:
        """One connection, logged in: ssh_config and the inventory's settings, host keys
        checked on the host and on every jump host to it; whatever fails is a
        :class:`ConnectError` naming the hop and the step."""
        t = self.target
        _check_files(t)
        conn = _connection(t)
        open_verified(conn, t)
        for hop in [*gateways(conn), conn]:
            transport = hop.client.get_transport()
            if transport is not None:
                transport.set_keepalive(KEEPALIVE_S)
                _bound_dead_peer(transport.sock)
        return conn

    def host(self) -> str | None:
        """The host name the first connection went to (ssh_config's HostName for an alias),
        or None before one is open."""
        with self._lock:
            return str(self._connections[0][0].host) if self._connections else None

    def peer_ip(self) -> str | None:
        """The IP address the first connection reached (ssh_config's HostName resolved), or None
        before one is open or when it goes through a proxy (no socket of its own)."""
        with self._lock:
            if not self._connections:
                return None
            transport = self._connections[0][0].client.get_transport()
        sock = getattr(transport, "sock", None)
        if not isinstance(sock, socket.socket):
            return None
        try:
            return str(sock.getpeername()[0])
        except OSError:
            return None

    @property
    def lost(self) -> str | None:
        """Why and when the host was lost (a connection to it died), if it was."""
        return self._lost

    def _check_alive(self) -> None:
        """A connection that died means the host is gone: say so at once, never wait on it."""
        for conn, _ in self._connections:
            transport = conn.client.get_transport()
            if transport is None or not transport.is_active():
                if self._lost is None:
                    self._lost = (f"lost contact with {self.target.label} at "
                                  f"{time.strftime('%H:%M:%S')} (its SSH connection died: no "
                                  f"answer within {DEAD_PEER_S}s)")
                raise ConnectError("ssh", self._lost)

    def session(self, timeout: float = 30.0) -> SshChannel:
        """A new session channel, on a connection that has room for it: at most
        :data:`SESSIONS_PER_CONNECTION` on one, fewer once the host's sshd refused one
        (``MaxSessions``): then the next opens on a new connection, and each connection
        holds no more than the host took from then on."""
        import paramiko

        while True:
            with self._lock:
                conn = self._room()
            try:
                channel = conn.client.get_transport().open_session(
                    timeout=min(timeout, self.target.connect_timeout_s))
            except paramiko.ChannelException as exc:
                self._refused(conn, exc)
                continue
            with self._lock:
                self._opened.setdefault(id(conn), []).append(channel)
            return cast(SshChannel, channel)

    def _room(self) -> Any:
        """A connection with room for one more session, counted (the lock is held)."""
        if not self._connections:
            self._connections.append((self._connect(), 0))
        self._check_alive()
        conn, used = self._connections[-1]
        opened = self._opened.get(id(conn), [])
        still = [c for c in opened if not c.closed]
        used -= len(opened) - len(still)  # closed since: room again
        self._opened[id(conn)] = still
        if used >= self._per_connection:
            try:
                conn, used = self._connect(), 0
            except ConnectError as exc:
                if self._per_connection >= SESSIONS_PER_CONNECTION:
                    raise
                raise ConnectError(exc.check, (
                    f"{self.target.label} allows {self._per_connection} session(s) per SSH "
                    f"connection (sshd MaxSessions) and another connection failed: "
                    f"{exc.detail}")) from None
            self._connections.append((conn, used))
        self._connections[-1] = (conn, used + 1)
        return conn

    def room(self) -> int:
        """Sessions the open connection still takes without another login (0: none open)."""
        with self._lock:
            if not self._connections or self._lost is not None:
                return 0
            conn, used = self._connections[-1]
            closed = sum(1 for c in self._opened.get(id(conn), []) if c.closed)
            return max(0, self._per_connection - used + closed)

    def _refused(self, conn: Any, exc: Exception) -> None:
        """The host refused a session on ``conn``: it holds no more than it has; a host that
        refuses the first session of a connection can run nothing."""
        with self._lock:
            index = next(i for i, (c, _) in enumerate(self._connections) if c is conn)
            took = self._connections[index][1] - 1
            if took <= 0:
                raise ConnectError("ssh", (
                    f"{self.target.label} refuses every session on a new SSH connection "
                    f"({exc}): sshd's MaxSessions is 0, or its configuration forbids sessions "
                    "for this user")) from None
            self._per_connection = min(self._per_connection, took)
            self._connections[index] = (conn, SESSIONS_PER_CONNECTION)  # full from now on
            if self.max_sessions is None or took < self.max_sessions:
                self.max_sessions = took

    def alive(self) -> bool:
        """Whether every connection to the host still stands (False once one died)."""
        with self._lock:
            try:
                self._check_alive()
            except ConnectError:
                return False
        return True

    def run(self, command: str, timeout: float) -> RunResult:
        """Run a command without a pty; output (stdout and stderr) and exit code, or
        :class:`TimeoutError` after ``timeout`` seconds (the channel is then closed)."""
        deadline = time.monotonic() + timeout
        channel = self.session(timeout)  # the session's opening counts towards the deadline
        try:
            channel.set_combine_stderr(True)
            channel.exec_command(command)
            chunks = []
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no end within {timeout:g}s")
                channel.settimeout(remaining)
                try:
                    data = channel.recv(65536)
                except TimeoutError:
                    raise TimeoutError(f"no end within {timeout:g}s") from None
                if not data:
                    break
                chunks.append(data)
            # The exit status is a message of its own and may trail the end of the output.
            while not channel.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.005)
            code = channel.recv_exit_status() if channel.exit_status_ready() else -1
            return RunResult(code, b"".join(chunks).decode("utf-8", errors="replace"))
        finally:
            channel.close()

    def close(self) -> None:
        """Close every connection (remote pty sessions get SIGHUP), then its jump hosts."""
        with self._lock:
            connections, self._connections = self._connections, []
            self._opened.clear()
        for conn, _ in connections:
            for hop in [conn, *reversed(gateways(conn))]:
                try:
                    hop.close()
                finally:
                    hop.client.close()


def _bound_dead_peer(sock: Any) -> None:
    """Make the kernel drop a connection whose data goes unacknowledged for DEAD_PEER_S (and
    probe an idle one), instead of retransmitting for a quarter of an hour."""
    if not isinstance(sock, socket.socket):
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000), ("TCP_KEEPIDLE", KEEPALIVE_S),
                        ("TCP_KEEPINTVL", KEEPALIVE_S), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


@dataclass
class Links:
    """Open links by node name, shared by preflight, launch and stop."""

    links: dict[str, Link] = field(default_factory=dict)

    def get(self, target: Target) -> Link:
        """The link to ``target``, created (not opened) on first use."""
        link = self.links.get(target.name)
        if link is None:
            link = self.links[target.name] = Link(target)
        return link

    def close(self, names: Sequence[str] | None = None) -> None:
        """Close the links of ``names`` (default: all)."""
        for name in list(self.links) if names is None else names:
            link = self.links.pop(name, None)
            if link is not None:
                link.close()
