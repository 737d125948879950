"""Logged-in hosts: per host, its connection and one agent channel per rank, opened in advance.

Logging in is most of what fan-out costs (the sshd session, the user's shell start-up files,
the interpreter starting), and it needs no plan: only the host and how many ranks it runs. So
the supervisor starts it first, from the hosts ``submit`` already planned, and plans, imports
and re-plans while the hosts log in. :meth:`HostPool.session` then waits for that host only.
At most ``fanout`` hosts are being logged into at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrate.backends.ssh.channels import AgentChannel
from orchestrate.backends.ssh.connections import Links, Target
from orchestrate.backends.ssh.wire import Abort, Preflight

if TYPE_CHECKING:
    from orchestrate.backends.ssh.spares import Spares

READY_TIMEOUT_S = 60.0  # login, shell start-up files and the interpreter starting


@dataclass
class HostSession:
    """One logged-in host: its channels (index = local rank) and what it was asked."""

    target: Target
    channels: list[AgentChannel] = field(default_factory=list)
    asked: Preflight | None = None
    hostname: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


class HostPool:
    """Hosts being logged into, or logged in; errors (ConnectError, ChannelError) are kept and
    raised to whoever asks for that host."""

    def __init__(self, fanout: int, secrets: list[str], links: Links | None = None,
                 spares: Spares | None = None) -> None:
        # A restart on the same hosts passes the last attempt's links (no new login) and the
        # agents started on them meanwhile (:mod:`.spares`: no agent to start either).
        self.links = links if links is not None else Links()
        self.spares = spares
        self.spares_taken = 0
        self.secrets = secrets
        self._executor = ThreadPoolExecutor(max_workers=max(1, fanout),
                                            thread_name_prefix="ssh-login")
        self._sessions: dict[str, Future[HostSession]] = {}
        self._lock = threading.Lock()

    def open(self, target: Target, nproc: int) -> None:
        """Start logging into ``target`` with ``nproc`` channels (returns at once)."""
        with self._lock:
            if target.name not in self._sessions:
                self._sessions[target.name] = self._executor.submit(self._login, target, nproc)

    def _login(self, target: Target, nproc: int) -> HostSession:
        session = HostSession(target)
        started = time.monotonic()
        link = self.links.get(target)
        link.open()
        connected = time.monotonic()
        if self.spares is not None:
            taken = self.spares.take(target.name, link, max(1, nproc))
            session.channels.extend(taken)
            with self._lock:
                self.spares_taken += len(taken)
        session.channels.extend(AgentChannel(link, target.python, self.secrets)
                                for _ in range(max(1, nproc) - len(session.channels)))
        session.channels[0].ready(READY_TIMEOUT_S)
        session.timings = {"connect_s": connected - started,
                           "ready_s": time.monotonic() - connected}
        return session

    def session(self, target: Target, nproc: int) -> HostSession:
        """The logged-in host with at least ``nproc`` channels (waits for its login)."""
        self.open(target, nproc)
        session = self._sessions[target.name].result()
        link = self.links.get(target)
        while len(session.channels) < nproc:
            session.channels.append(AgentChannel(link, target.python, self.secrets))
        return session

    def sessions(self) -> dict[str, HostSession]:
        """Every host logged in successfully so far (without waiting)."""
        done = {}
        for name, future in list(self._sessions.items()):
            if future.done() and future.exception() is None:
                done[name] = future.result()
        return done

    def trim(self, name: str, keep: int) -> None:
        """Keep ``keep`` channels of host ``name``; with 0, log out of it altogether."""
        future = self._sessions.get(name)
        if future is None:
            return
        with contextlib.suppress(Exception):
            session = future.result()
            for channel in session.channels[keep:]:
                abort(channel)
            del session.channels[keep:]
        if not keep:
            del self._sessions[name]
            self.links.close([name])

    def names(self) -> list[str]:
        """Hosts logged into or being logged into."""
        return list(self._sessions)

    def close(self, abort_all: bool, keep_links: bool = False) -> None:
        """Close every connection; with ``abort_all`` first tell each agent nothing starts.
        ``keep_links``: close the agents' channels only, and keep the connections that still
        answer (logged in) for the next attempt's pool."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.spares is not None:  # those no login took
            self.spares.close()
        if abort_all:
            for session in self.sessions().values():
                for channel in session.channels:
                    abort(channel)
            time.sleep(0.05)  # let the abort lines leave before the connections close
        if not keep_links:
            self.links.close()
            return
        for session in self.sessions().values():
            for channel in session.channels:
                channel.close()
        self.links.close([name for name, link in self.links.links.items() if not link.alive()])


def abort(channel: AgentChannel) -> None:
    """Tell the agent nothing will start (it releases its claim and exits); close."""
    with contextlib.suppress(Exception):  # already gone: nothing to release
        channel.send(Abort())
    channel.close()
