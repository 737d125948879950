"""Spare agents: the next attempt's agents, started while this attempt runs (issue #37).

A restart on the same hosts keeps the attempt's connections, but each rank's agent is a new
interpreter on its host, started over a new pty session: ~0.2 s that a restart paid after the
failure. A spare is that same agent (``python -S -c <agent> serve``: its environment is the
login's, nothing of the attempt is in it), started on the kept connection once the attempt's
ranks run: the restart's :class:`~orchestrate.backends.ssh.sessions.HostPool` takes it instead
of starting one, and the new attempt's facts (attempt number, master port, the re-rendered
launch script) reach it as they reach a fresh agent, in its requests.

They start only once every rank has said something (or ended), so they never compete with the
ranks' own start; only when a restart can follow; and only as many as the open connection holds
beside the ranks' sessions and two kept free for kill-by-tag and the stall watch's reads (no
login of their own). On a host whose ranks fill the connection, the rest start at the
attempt's end, once its agents' sessions closed (:meth:`Spares.refill`), beside the restart
decision.

A spare dies the way every agent does: it is the session leader of its pty, so when its channel
or connection closes (the job's end, a cancel, a restart elsewhere, the supervisor's death) it
gets SIGHUP and exits; it holds nothing of the job (no lease, no process) until it is told to.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from orchestrate.backends.ssh.channels import AgentChannel
from orchestrate.backends.ssh.connections import Link, Links, Target

#: How long spares wait for every rank to say something before they start anyway.
QUIET_RANKS_S = 30.0
#: Sessions left free on a connection beside the ranks' and the spares' (a kill-by-tag run and
#: a stall-watch read at once): neither ever needs another login.
KEEP_FREE = 2


class Spares:
    """The next attempt's agents, by host: started in the background, taken by the restart's
    pool, the rest closed (:meth:`close`)."""

    def __init__(self, links: Links, targets: Mapping[str, Target], wanted: Mapping[str, int],
                 secrets: list[str]) -> None:
        self.links = links
        self.targets = dict(targets)
        self.wanted = dict(wanted)  # host -> agents its ranks use
        self.secrets = secrets
        self._ready: dict[str, tuple[Link, list[AgentChannel]]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, ranks: Sequence[AgentChannel]) -> None:
        """Start the spares in the background once every channel of ``ranks`` has shown its
        rank's output or ended (at most :data:`QUIET_RANKS_S`)."""
        self._spawn(self._first, list(ranks))

    def refill(self) -> None:
        """The attempt's agents are gone and their sessions closed: start, in the background,
        the spares that found no room beside them (a host with a rank per session the
        connection holds)."""
        self._spawn(self._fill)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="ssh-spares")
        self._threads.append(thread)
        thread.start()

    def _first(self, ranks: list[AgentChannel]) -> None:
        deadline = time.monotonic() + QUIET_RANKS_S
        while not all(c.spoke.is_set() or c.ended.is_set() or c.exit is not None
                      for c in ranks):
            if self._closed.wait(0.02) or time.monotonic() > deadline:
                break
        self._fill()

    def _fill(self) -> None:
        for name, count in self.wanted.items():
            with contextlib.suppress(Exception):  # a host gone: its restart starts agents
                self._open(name, count)

    def _open(self, name: str, count: int) -> None:
        link = self.links.links.get(name)
        if link is None:
            return
        for _ in range(count):
            if link.room() <= KEEP_FREE:
                return
            with self._lock:  # one opening at a time: two fills never open more than count
                channels = self._ready.setdefault(name, (link, []))[1]
                if self._closed.is_set() or len(channels) >= count:
                    return
                channels.append(AgentChannel(link, self.targets[name].python, self.secrets))

    def take(self, name: str, link: Link, most: int) -> list[AgentChannel]:
        """At most ``most`` of ``name``'s spares that still run, for its next attempt on
        ``link`` (the one they were started on: none for another connection); the others of
        that host are closed."""
        self._wait()
        with self._lock:
            on, channels = self._ready.pop(name, (None, []))
        live = [c for c in channels if not c.ended.is_set()][:most] if on is link else []
        for channel in channels:
            if channel not in live:
                channel.close()
        return live

    def _wait(self) -> None:
        for thread in list(self._threads):
            thread.join(timeout=QUIET_RANKS_S + 30.0)

    def close(self) -> None:
        """Close the spares not taken (their agents get SIGHUP and exit)."""
        self._closed.set()
        self._wait()
        with self._lock:
            ready, self._ready = self._ready, {}
        for _, channels in ready.values():
            for channel in channels:
                with contextlib.suppress(Exception):
                    channel.close()

