"""The shared lease book's files and folder (hostside/leases.py, bookdir.py), one user: the
permissions it makes and refuses, its bounded lock, leases it cannot read, first come first
served tickets, the last holder leaving and survivors. Files only (unit tier); two real users
are in tests/backends/local/test_local_users.py and tests/backends/ssh/test_ssh_users.py."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

import pytest

from orchestrate.hostside import bookdir, leases

pytestmark = pytest.mark.unit


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_book_is_made_shared_with_the_sticky_bit(tmp_path: Path) -> None:
    root = tmp_path / "var" / "leases"
    book = leases.LeaseBook(str(root), "box")
    assert _mode(root) == 0o1777 and _mode(root / "box") == 0o1777
    with book.locked():
        book.record(leases.new_lease("j1", "localhost", [0, 1], 0, 29500, [os.getpid()]))
    [lease] = (root / "box").glob("j1@*.json")
    assert lease.name == f"j1@{os.geteuid()}.json"
    assert _mode(lease) == 0o644  # who holds which GPU is no secret on a shared box
    with book.locked():
        [live] = book.live()
    assert live.gpus == [0, 1] and live.port == 29500


@pytest.mark.parametrize("mode", [0o777, 0o757])
def test_a_folder_others_may_write_without_the_sticky_bit_is_refused_not_chmodded(
        tmp_path: Path, mode: int) -> None:
    root = tmp_path / "leases"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(leases.BookError) as refused:
        leases.LeaseBook(str(root), "box")
    assert "has no sticky bit" in str(refused.value)
    assert refused.value.hint == f"chmod 1777 {root}"
    assert _mode(root) == mode  # never changed behind the user's back


def test_a_symbolic_link_for_the_book_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "leases").symlink_to(tmp_path / "real")
    with pytest.raises(leases.BookError, match="is a symbolic link"):
        leases.LeaseBook(str(tmp_path / "leases"), "box")


@pytest.mark.timing
def test_a_held_lock_is_waited_for_a_bounded_time_and_its_holder_named(tmp_path: Path) -> None:
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    with book.locked():
        pass  # the lock file exists now
    fd = os.open(str(tmp_path / "leases" / "box" / bookdir.LOCK_FILE), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: conflicts as another process would
        with pytest.raises(leases.BookError) as stuck, book.locked(wait_s=0.3):
            pass
    finally:
        os.close(fd)
    assert "stayed locked for 0.3s by" in str(stuck.value)
    assert f"pid {os.getpid()}" in str(stuck.value)


def test_a_lease_that_cannot_be_read_is_honoured_and_its_owner_named(tmp_path: Path) -> None:
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    (tmp_path / "leases" / "box" / f"broken@{os.geteuid()}.json").write_text("{not json")
    with book.locked():
        [entry] = book.live()
    assert entry.job_id == "broken" and "cannot be read" in entry.unreadable
    with book.locked():
        held = leases.held(book.live())
    assert held["unknown"]  # a claim is refused while it is honoured
    claim = book.claim(leases.new_lease("j2", "localhost", [3], 0, None, [os.getpid()]))
    assert claim["ok"] is False and claim["unknown"]


def test_a_claim_waits_behind_an_older_ticket_for_the_same_gpus(tmp_path: Path) -> None:
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    me, start = os.getpid(), None
    older = leases.Ticket(job_id="first", uid=os.geteuid(), submitted_at=time.time(),
                          gpus=[0], holders=[(me, start)])
    with book.locked():
        book.enqueue(older)
    later = book.claim(leases.new_lease("second", "localhost", [0], 0, None, [me]))
    assert later["ok"] is False and later["queue"] and "job first" in later["queue"][0]
    other_gpu = book.claim(leases.new_lease("third", "localhost", [1], 0, None, [me]))
    assert other_gpu["ok"] is True  # a ticket holds back only what it waits for


def test_a_lease_is_dropped_when_its_last_holder_leaves(tmp_path: Path) -> None:
    """The last holder to leave (an SSH agent, which has no watchdog after it) drops the lease:
    no stale file is left on the host."""
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    with book.locked():
        book.record(leases.new_lease("last-1", "box", [0], 0, None, [os.getpid()]))
    assert book.leave("last-1", [os.getpid()]) is True
    assert not list((tmp_path / "leases" / "box").glob("last-1@*.json"))


def test_a_survivor_holds_the_lease_and_is_named_to_whoever_is_refused(tmp_path: Path) -> None:
    """A process that outlived its job's end (here: this test's parent, alive and not of the
    job) is recorded as the lease's survivor: the lease stays, and describe() names it."""
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    with book.locked():
        book.record(leases.new_lease("surv-1", "box", [0], 0, None, [os.getpid()]))
    survivor = os.getppid()
    assert book.leave("surv-1", [os.getpid()], [survivor]) is False
    with book.locked():
        [lease] = book.live()
    assert [pid for pid, _ in lease.survivors] == [survivor]
    said = leases.describe(lease)
    assert said.startswith("job surv-1 (") and f"but pid {survivor} (" in said
    assert said.endswith("outlived SIGKILL and still run)")
