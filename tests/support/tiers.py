"""Test tiers: every test carries exactly one, and a ``unit`` test is held to its promise.

The tiers say what a test needs, so a person can pick the loop that fits (``pytest -m unit`` is
the inner loop: seconds, no processes) and CI can fail fast:

- ``unit``: starts no process and opens no socket;
- ``process``: starts real processes on this machine (no cluster);
- ``ssh``: the real sshd test hosts (tests/clusters/sshhosts.sh);
- ``slurm``: the real Slurm test cluster (tests/clusters/slurm.sh);
- ``gpu``: a CUDA GPU (skipped, with the reason, without one).

``torch`` and ``frameworks`` are extra marks, not tiers. The closest tier mark wins: a test's
own ``@pytest.mark.process`` overrides its module's ``pytestmark = pytest.mark.unit``, so a file
of pure tests with one that starts a process says so once, at that test. A test with no tier
mark, or two at the same level, stops the collection with its name (a new unmarked test fails
loudly instead of running in no tier).

Why a guard: a ``unit`` mark that lies makes the inner loop slow and flaky. While a ``unit``
test's setup, call and teardown run, an audit hook (and a wrapper of ``_posixsubprocess``,
which multiprocessing calls without an audit event) refuses process starts and sockets; the
refusal is also recorded, so a test that catches the exception still fails.
"""

from __future__ import annotations

import _posixsubprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

TIERS = ("unit", "process", "ssh", "slurm", "gpu")

#: Audit events that start a process or open a socket (docs.python.org/3/library/audit_events).
FORBIDDEN_EVENTS = frozenset({
    "subprocess.Popen", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
    "os.system", "os.startfile", "pty.spawn",
    "socket.__new__", "socket.bind", "socket.connect",
})


class UnitTierViolation(RuntimeError):
    """A ``unit`` test started a process or opened a socket."""


class _Guard:
    """Refuses process starts and sockets while ``active``; remembers what it refused."""

    def __init__(self) -> None:
        self.active = False
        self.installed = False
        self.refused: list[str] = []

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.active and event in FORBIDDEN_EVENTS:
            self._refuse(f"{event}{_short(args)}")

    def _refuse(self, what: str) -> None:
        self.active = False  # the test's own cleanup (and pytest's reporting) may need both
        self.refused.append(what)
        raise UnitTierViolation(
            f"a unit test may start no process and open no socket: {what}; mark it "
            "@pytest.mark.process (or the tier it needs)")

    def fork_exec(self, real: Callable[..., int]) -> Callable[..., int]:
        def guarded(*args: Any, **kwargs: Any) -> int:
            if self.active:
                self._refuse(f"_posixsubprocess.fork_exec({_short(args[:1])})")
            return real(*args, **kwargs)
        return guarded


def _short(args: tuple[Any, ...]) -> str:
    text = repr(args)
    return text if len(text) <= 160 else text[:157] + "..."


GUARD = _Guard()


def install() -> None:
    """Installs the audit hook and the ``fork_exec`` wrapper, once per interpreter (an audit
    hook cannot be removed; a pytest run inside a test shares them)."""
    if GUARD.installed:
        return
    GUARD.installed = True
    sys.addaudithook(GUARD.audit)
    _posixsubprocess.fork_exec = GUARD.fork_exec(_posixsubprocess.fork_exec)


def _tier_marks(node: pytest.Item | pytest.Collector) -> list[str]:
    return [mark.name for mark in node.own_markers if mark.name in TIERS]


def resolve(items: list[pytest.Item]) -> None:
    """Gives every item exactly one tier mark, its closest; raises a UsageError naming every
    test without one (or with two at one level). Module and class tier marks are moved onto
    the items, so ``-m`` sees the resolved tier only."""
    problems: list[str] = []
    parents: set[pytest.Item | pytest.Collector] = set()
    for item in items:
        tier: str | None = None
        for node in item.listchain()[::-1]:  # the item first, then class, module, package
            found = _tier_marks(node)
            if node is not item:
                parents.add(node)
            if len(found) > 1:
                problems.append(f"{item.nodeid}: two tier marks at one level: {found}")
            if found:
                tier = found[0]
                break
        if tier is None:
            problems.append(f"{item.nodeid}: no tier mark (one of {', '.join(TIERS)})")
        elif not _tier_marks(item):
            item.add_marker(tier)
    if problems:
        raise pytest.UsageError(
            "every test carries one tier mark (tests/support/tiers.py):\n  "
            + "\n  ".join(problems))
    for node in parents:
        node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in TIERS]
        own = getattr(node.keywords, "_markers", {})  # what ``-k`` matches (pytest's own dict)
        for name in TIERS:
            own.pop(name, None)


def tier_of(item: pytest.Item) -> str | None:
    return next((mark.name for mark in item.iter_markers() if mark.name in TIERS), None)


#: The tiers whose tests share one machine-wide thing started once per session (the sshd test
#: hosts and their network namespaces, the Slurm cluster): run by one worker at a time.
SHARED_TIERS = ("ssh", "slurm")


def group_of(item: pytest.Item) -> str:
    """The ``xdist_group`` of a test (see :func:`group`)."""
    if item.get_closest_marker("slurm_release") is not None:
        return "slurm_release"  # the second Slurm cluster: one worker, beside the first's
    tier = tier_of(item)
    return tier if tier in SHARED_TIERS else item.nodeid.split("::", 1)[0]


def group(items: list[pytest.Item]) -> None:
    """Which tests one pytest-xdist worker runs together (``pytest -n 2``, ``--dist loadgroup``
    in pyproject.toml): every ``ssh`` test in one group and every ``slurm`` test in another,
    since each tier's cluster is one per machine (the tests of the second Slurm release, marked
    ``slurm_release``, in a third: another cluster, which may run beside the first's); any other
    test with the rest of its file, so that a module's shared fixture (one training run
    asserted many ways) is made once. Without xdist the marks change nothing."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))


#: What one test of a tier costs a worker, in seconds, and what a ``torch`` mark adds to a
#: test that starts processes (its ranks import torch and train): about the means of run A's
#: tests (docs/performance.md, "The test suite's time"). Only the order they give matters.
COST_S = {"unit": 0.1, "process": 2.5, "ssh": 11.0, "slurm": 15.0, "gpu": 0.1}
TORCH_S = 20.0


def cost_of(item: pytest.Item) -> float:
    """The estimated seconds of one test, by its tier and its ``torch`` mark."""
    tier = tier_of(item) or ""
    ranks = item.get_closest_marker("torch") is not None and tier not in ("unit", "gpu")
    return COST_S.get(tier, 1.0) + (TORCH_S if ranks else 0.0)


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, the groups costliest first (each group's tests in their
    order). ``--dist loadgroup`` hands a worker the next group in collection order whenever it
    is nearly out of work (pyproject.toml turns off xdist's own reorder, by number of tests,
    which put the files of one or two long training runs last: one of them ended the suite
    while the other worker sat idle). So the two clusters' groups start at once, on the two
    workers, and the quick unit files fill the end. Every worker sorts the same collection
    the same way; a run without xdist keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        name = group_of(item)
        cost[name] = cost.get(name, 0.0) + cost_of(item)
        first.setdefault(name, index)
    items.sort(key=lambda item: (-cost[group_of(item)], first[group_of(item)]))


def _guarded(item: pytest.Item, on: bool) -> Iterator[None]:
    """Runs a test phase (the ``yield``) with the guard on when ``on`` and the item is a unit
    test; fails the test if the guard refused anything, caught or not."""
    if not on or tier_of(item) != "unit":
        return (yield)
    before = len(GUARD.refused)
    GUARD.active = True
    try:
        result = yield
    finally:
        GUARD.active = False
    refused = GUARD.refused[before:]
    if refused:
        pytest.fail(f"unit test started a process or opened a socket: {refused[0]} (mark it "
                    "@pytest.mark.process, or the tier it needs)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def guarded_setup(item: pytest.Item) -> Iterator[None]:
    """Setup, with the fixtures the test is the first to ask for (a module or session fixture
    a unit test starts is the unit test's)."""
    return (yield from _guarded(item, True))


@pytest.hookimpl(wrapper=True)
def guarded_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item, True))


@pytest.hookimpl(wrapper=True)
def guarded_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Teardown is guarded only while the next test is in the same module: at a module's end
    (and the session's) pytest also tears down the module and session fixtures that earlier,
    other tests asked for, whose stopping is not this test's doing."""
    same_module = nextitem is not None and nextitem.module is item.module  # type: ignore[attr-defined]
    return (yield from _guarded(item, same_module))
