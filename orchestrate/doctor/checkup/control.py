"""The checkup's control plane: rank 0's TCPStore, and a watchdog that bounds every step.

The job's own rendezvous store (a TCPStore on MASTER_ADDR:MASTER_PORT, hosted by rank 0) carries
everything that must work when the collectives do not: who joined, which step each rank is in,
what a failing rank saw, and the results. Keys live under ``checkup/``; the process group gets
its own prefix so the two never meet.

Every rank runs a :class:`Watchdog` thread. A step that outlives its bound, or a stop signal from
rank 0 (another rank failed), ends the rank through the failure path within about a second, so
nobody waits for torch's own timeouts and rank 0 can tell a rank that reports from one that
went silent. Each rank keeps a second store connection (:meth:`Control.side`) for that path,
because the main one may be stuck in a request when the watchdog fires.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

PREFIX = "checkup/"
#: How often the watchdog looks at the store for a stop signal.
POLL_S = 1.0
#: Store requests on the failure path give up after this long (the master may be gone).
SIDE_TIMEOUT_S = 3.0


def _key(*parts: object) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


class Control:
    """One rank's connection to rank 0's store, and the protocol spoken over it."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int) -> None:
        self.addr, self.port, self.rank, self.world_size = addr, port, rank, world_size
        self.store: Store | None = None
        self._side: Store | None = None
        # The side connection serves two threads (the watchdog's polls, the failure path);
        # a store client is one socket, so its requests must not interleave.
        self._side_lock = threading.RLock()

    @property
    def master(self) -> str:
        return f"{self.addr}:{self.port}"

    def connect(self, timeout_s: float) -> Store:
        """Host the store (rank 0) or connect to it, retrying until ``timeout_s``."""
        self.store = TCPStore(
            self.addr,
            self.port,
            self.world_size,
            is_master=self.rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return self.store

    @contextmanager
    def side(self) -> Iterator[Store]:
        """A second connection for the watchdog and the failure path (opened once), held
        by one thread at a time."""
        with self._side_lock:
            if self._side is None:
                assert self.store is not None
                side: Store = self.store.clone()  # type: ignore[attr-defined]
                side.set_timeout(timedelta(seconds=SIDE_TIMEOUT_S))
                self._side = side
            yield self._side

    def _main(self) -> Store:
        assert self.store is not None, "connect first"
        return self.store

    # -- joining -------------------------------------------------------------------------------

    def announce(self, info: dict[str, Any]) -> None:
        store = self._main()
        store.set(_key("join", self.rank), json.dumps(info))
        store.add(_key("joined"), 1)

    def joined_count(self) -> int:
        """How many ranks have announced themselves (one request, however many ranks)."""
        return int(self._main().add(_key("joined"), 0))

    def joined(self) -> list[int]:
        """Ranks that have announced themselves (rank 0 asks)."""
        store = self._main()
        return [r for r in range(self.world_size) if store.check([_key("join", r)])]

    def members(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        if not ranks:
            return []
        values = self._main().multi_get([_key("join", r) for r in ranks])
        return [json.loads(v) for v in values]

    def publish_roster(self, roster: dict[str, Any]) -> None:
        self._main().set(_key("roster"), json.dumps(roster))

    def roster(self, timeout_s: float) -> dict[str, Any]:
        """Rank 0's answer to the join: ``{"ok": true, "ranks": [...]}`` or a failure."""
        store = self._main()
        store.wait([_key("roster")], timedelta(seconds=timeout_s))
        value: dict[str, Any] = json.loads(store.get(_key("roster")))
        store.add(_key("roster_read"), 1)
        return value

    def wait_roster_read(self, count: int, timeout_s: float) -> None:
        """Rank 0, before it exits after a failed join: let ``count`` ranks read why (the
        store dies with rank 0)."""
        store = self._main()
        deadline = time.monotonic() + timeout_s
        while int(store.add(_key("roster_read"), 0)) < count and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- progress, failures and results ---------------------------------------------------------

    def enter(self, step: str) -> None:
        """Record the step this rank is in (read by rank 0 when the rank goes silent)."""
        self._main().set(_key("step", self.rank), step)

    def report_failure(self, report: dict[str, Any]) -> None:
        with self.side() as side:
            side.set(_key("fail", self.rank), json.dumps(report))
            side.add(_key("failures"), 1)

    def failures(self) -> int:
        with self.side() as side:
            return int(side.add(_key("failures"), 0))

    def stop_all(self, reason: str) -> None:
        """Tell every rank to stop (rank 0, once a failure is certain)."""
        with self.side() as side:
            side.set(_key("stop"), reason)

    def stop_reason(self) -> str | None:
        with self.side() as side:
            if side.check([_key("stop")]):
                return str(side.get(_key("stop")).decode())
            return None

    def mark_done(self) -> None:
        """Rank 0, after a failure: the result is written and printed; the others may go."""
        with self.side() as side:
            side.set(_key("done"), "1")

    def wait_done(self, timeout_s: float) -> None:
        """Until rank 0 marked the result done, its store is gone, or ``timeout_s`` passed
        (never raises)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with self.side() as side:
                    if side.check([_key("done")]):
                        return
            except Exception:
                return  # rank 0's store went with rank 0
            time.sleep(0.1)

    def post_result(self, part: dict[str, Any]) -> None:
        self._main().set(_key("result", self.rank), json.dumps(part))

    def accounted(self, rank: int) -> str | None:
        """``"fail"`` or ``"result"`` once ``rank`` posted one (side connection)."""
        with self.side() as side:
            for kind in ("fail", "result"):
                if side.check([_key(kind, rank)]):
                    return kind
            return None

    def read(self, kind: str, rank: int) -> Any:
        with self.side() as side:
            return json.loads(side.get(_key(kind, rank)))

    def last_step(self, rank: int) -> str | None:
        with self.side() as side:
            if side.check([_key("step", rank)]):
                return str(side.get(_key("step", rank)).decode())
            return None

    def accounts(self, grace_s: float
                 ) -> tuple[dict[int, dict[str, Any]], list[int], dict[int, str]]:
        """Rank 0, after a failure: within ``grace_s``, every rank's failure report as it comes
        (rank -> ``{"step", "kind", "detail"}``), the ranks that gave no account at all (no
        report, no result: silent), and the last step each silent rank entered."""
        failed: dict[int, dict[str, Any]] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                with suppress(Exception):
                    state = self.accounted(r)
                    if state == "fail":
                        failed[r] = dict(self.read("fail", r))
                    if state is not None:
                        pending.discard(r)
            if pending:
                time.sleep(0.1)
        last: dict[int, str] = {}
        for r in sorted(pending):
            seen = None
            with suppress(Exception):
                seen = self.last_step(r)
            if seen:
                last[r] = seen
        return failed, sorted(pending), last

    def results(self, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Every rank's result part (rank 0); raises TimeoutError with the missing ranks."""
        store = self._main()
        keys = [_key("result", r) for r in range(self.world_size)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                raise TimeoutError(missing) from None
        return {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))}


class Watchdog:
    """Bounds the current step, and stops the rank when told to.

    ``expire(step, kind, detail)`` runs in the watchdog thread when the armed step outlives its
    bound (``timeout``), when the whole checkup passes its deadline, or when ``poll`` returns a
    reason to stop (``aborted``); the process exits with status 1 once it returns, or after a
    backstop if it hangs itself.
    """

    def __init__(
        self,
        expire: Callable[[str, str, str], None],
        deadline_s: float,
        backstop_s: float,
    ) -> None:
        self._expire = expire
        self._lock = threading.Lock()
        self._step = "start"
        self._bound = 0.0
        self._until: float | None = None
        self._hard = time.monotonic() + deadline_s
        self._deadline_s = deadline_s
        self._backstop_s = backstop_s
        self._poll: Callable[[], str | None] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkup-watchdog", daemon=True)
        self._thread.start()

    @property
    def step(self) -> str:
        with self._lock:
            return self._step

    def arm(self, step: str, bound_s: float) -> None:
        """Start bounding ``step``: it must finish (or :meth:`tick`) within ``bound_s``."""
        with self._lock:
            self._step, self._bound = step, bound_s
            self._until = time.monotonic() + bound_s

    def tick(self) -> None:
        """Progress in the current step: its bound starts again from now."""
        with self._lock:
            if self._until is not None:
                self._until = time.monotonic() + self._bound

    def polling(self, poll: Callable[[], str | None] | None) -> None:
        """Ask ``poll`` every :data:`POLL_S` whether to stop (errors count as "no")."""
        with self._lock:
            self._poll = poll

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        next_poll = time.monotonic() + POLL_S
        while not self._stopped.wait(0.2):
            now = time.monotonic()
            with self._lock:
                step, bound, until, poll = self._step, self._bound, self._until, self._poll
            if now > self._hard:
                self._fire(step, "timeout", f"the checkup ran past its {self._deadline_s:g} s "
                                            "deadline")
            elif until is not None and now > until:
                self._fire(step, "timeout", f"no progress for {bound:g} s")
            elif poll is not None and now >= next_poll:
                next_poll = now + POLL_S
                try:
                    reason = poll()
                except Exception:  # the master may be gone; the step bounds still hold
                    reason = None
                if reason:
                    self._fire(step, "aborted", reason)

    def _fire(self, step: str, kind: str, detail: str) -> None:
        backstop = threading.Timer(self._backstop_s, _exit_now)
        backstop.daemon = True
        backstop.start()
        try:
            self._expire(step, kind, detail)
        finally:
            _exit_now()


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
