"""The lease book's typed records (hostside/leaserecord.py): what a writer writes a reader reads
back, and a file with one field of the wrong type is refused naming that field, never a
``TypeError`` later (issue #32, class 3). Values only (unit tier)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from orchestrate.backends.sharing import book_error
from orchestrate.core.exits import EXIT_BUSY, EXIT_SETUP
from orchestrate.hostside import leases
from orchestrate.hostside.leaserecord import Lease, RecordError, Ticket, held, summary

pytestmark = pytest.mark.unit


def test_a_lease_and_a_ticket_read_back_what_was_written() -> None:
    lease = Lease(job_id="j1", uid=1001, user="ann", gpus=[0, 3], slots=0, port=29500,
                  holders=[(4242, 123), (4243, None)], cgroup="/sys/fs/cgroup/x", since=1.5e9,
                  left=["pid 9 outlived the job"], survivors=[(9, 77)])
    assert Lease.from_json(lease.to_json()) == lease
    ticket = Ticket(job_id="w1", uid=1002, submitted_at=1.7e9, gpus=[1], port=None,
                    holders=[(55, 66)], since=1.7e9)
    assert Ticket.from_json(ticket.to_json()) == ticket


def test_fields_a_reader_does_not_know_are_ignored_and_an_older_lease_is_read() -> None:
    old = {"job_id": "j0", "gpus": [1], "holder_pid": 42, "holder_start": 7, "newer": {"x": 1}}
    lease = Lease.from_json(json.dumps(old))
    assert lease.holders == [(42, 7)] and lease.gpus == [1]


@pytest.mark.parametrize(("field", "value"), [
    ("gpus", 5), ("gpus", ["0"]), ("gpus", [True]), ("port", "x"), ("port", 70000),
    ("since", 1e300), ("since", float("nan")), ("slots", -1), ("holders", [[1]]),
    ("holders", [["1", None]]), ("job_id", ""), ("job_id", "../x"), ("left", [1]),
    ("uid", "ann"), ("cgroup", 5),
])
def test_a_field_of_the_wrong_type_is_refused_naming_the_field(field: str, value: object
                                                                ) -> None:
    text = json.dumps({"job_id": "j1", field: value}, allow_nan=True)
    with pytest.raises(RecordError, match=rf"^{field}: "):
        Lease.from_json(text)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff", "null"])
def test_what_is_not_a_json_object_is_refused(text: str) -> None:
    with pytest.raises(RecordError):
        Ticket.from_json(text.encode("latin-1"))


def test_a_ticket_with_a_place_out_of_range_is_refused() -> None:
    with pytest.raises(RecordError, match=r"^submitted_at: not a time"):
        Ticket.from_json(json.dumps({"job_id": "w", "submitted_at": -1}))


def test_a_report_of_many_bad_files_is_a_few_lines_and_a_count() -> None:
    lines = [f"/book/x{i}@1002.json of ben cannot be read" for i in range(1000)]
    said = summary(lines, "/book")
    assert said[:5] == lines[:5] and said[5:] == ["... and 995 more files of /book like these"]
    unreadable = [Lease(job_id=f"x{i}", uid=1002, unreadable=line) for i, line in
                  enumerate(lines)]
    assert len(held(unreadable)["unknown"]) == 6


def test_temporary_names_are_unguessable_and_none_is_left(tmp_path: Path) -> None:
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    names = {book._temp(b"x") for _ in range(3)}
    assert all(re.fullmatch(r"\.[0-9a-f]{16}\.tmp", os.path.basename(n)) for n in names)
    assert len(names) == 3
    for name in names:
        os.unlink(name)
    with book.locked():
        book.record(leases.new_lease("j1", "box", [0], 0, None, [os.getpid()]))
        book.record(leases.new_lease("j1", "box", [1], 0, None, [os.getpid()]))
    assert sorted(p.name for p in (tmp_path / "leases" / "box").iterdir()) == \
        [".lock", f"j1@{os.geteuid()}.json"]


def test_an_unusable_book_is_the_machines_setup_not_the_users_mistake() -> None:
    setup = book_error(leases.BookError("the lease book /b belongs to ann", "install -d"), "j")
    assert setup.exit_status == EXIT_SETUP == 78
    busy = book_error(leases.BookError("stayed locked", "ask", busy=True), "j")
    assert busy.exit_status == EXIT_BUSY
